"""The model's layers as the sampler and the training forward run them.

    static_decoder.py    decoder layers written out per family (the `FAMILIES` table): one layer function that the
                         written-out training forward and the fast decoder behind sampling.sample both call
    head.py              the final-logit transform (a scale, a softcap), for the sampler and the training head alike
    static_moe.py        Mixture-of-Experts blocks, their experts read in place (or a rank's share copied, with TP)
    static_recurrent.py  Gated DeltaNet layers (Qwen3.5) with their states per row
    hf_decoder.py        the general path: the model's own forward over a cache whose masks are ours
    tensor_parallel.py   which slice of each weight a rank of a tensor-parallel group holds, and the sum joining them
    kernels.py           Triton decode attention for the GPU (its plain PyTorch math is the CPU path)
    lora.py              LoRA adapters on a model's weight matrices, and how the fast paths read them
    routing.py           routing replay: the training forward sends each token to the experts the sampler chose
    vision.py            images in prompts: encoded once per group, through prefill and the training forwards

Imports: torch and transformers, and one another; nothing else of the project.
"""
