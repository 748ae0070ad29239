"""The model's layers as the sampler and the training forward run them.

    transformer.py       the model written out: the family table (`FAMILIES`), the one decision of which path each
                         phase takes (`decide`), one layer function and the parameters it reads, the training forward
    engine.py            the fast decoder behind sampling.sample: weight copies (read whole by `Whole`, or cut by a
                         tensor-parallel Slice), KV cache, prefill, decode
    cuda_graphs.py       the decoder's decode steps captured as CUDA graphs, one per batch bucket and cache span
    head.py              the final-logit transform (a scale, a softcap), for the sampler and the training head alike
    static_moe.py        Mixture-of-Experts blocks, their experts read in place (or a rank's share copied, with TP)
    static_recurrent.py  Gated DeltaNet layers (Qwen3.5) with their states per row
    shared_prefill.py    the decoder's prefill with rows of one prompt running it once (--shared_prompts)
    hf_decoder.py        the general path: the model's own forward over a cache whose masks are ours
    tensor_parallel.py   tensor parallelism in one file: how each kind of weight is cut, what cannot be, the sum
                         joining the slices, the group's rows and answers, the vocabulary-sliced draw's collectives
    kernels.py           Triton decode attention for the GPU (its plain PyTorch math, transformer.grouped_attention,
                         is the CPU path)
    shards.py            what a weight is under FSDP2 (a plain tensor or a DTensor) and which ranks cut its rows
    lora.py              LoRA adapters on a model's weight matrices, and how the fast paths read them
    routing.py           routing replay: the decoder records each token's experts (`Records`), and the training
                         forward sends each token to the experts the sampler chose
    vision.py            images in prompts: encoded once per group, through prefill and the training forwards

Imports: torch and transformers, and one another; nothing else of the project.
"""
