"""Tensor-parallel decoding against one rank, for tests/test_tensor_parallel.py: run under torchrun with gloo (4
processes), it writes one JSON line per (family, group size, case) to the file named by its argument. The same launch
exports three models sharded over the 4 processes (`export`): the export's check at 4 processes.

Every rank builds the same tiny model. Groups of 2 (ranks 0-1 and 2-3) and of 4 decode the same rows as one rank
decoding alone with the whole layers; greedy tokens are compared with the model's own `generate` as well. Each rank
records its tokens, its log-probs' largest difference from the whole decoder's, and the bytes its decoder's copies
hold, with the parts a family keeps whole on every rank (norms, routers) or on rank 0 only (row-sliced biases)
counted from the model's own parameters, not from the decoder.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import architectures  # noqa: E402
import sampling  # noqa: E402
from features import sampler_options  # noqa: E402
from layers import transformer  # noqa: E402
from layers.tensor_parallel import Slice  # noqa: E402

# the families of the tests' table that the launch runs, at the settings their rows give for it (T = 4 needs
# heads, K/V heads, intermediate sizes and recurrent heads that divide by 4). "kv2": 4 query heads over 2 K/V
# heads, so at T = 4 two ranks hold a copy of each K/V head (rows with tp_kv_copies)
FAMILIES = {name: row.tp for name, row in architectures.FAMILIES.items() if row.tp is not None}
EVERY_CASE = ("llama",)  # the others: greedy and several turns (sampled) only
DIVIDING = dict(num_key_value_heads=4)  # every family's K/V heads split 1 per rank at T = 4


def bytes_of(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def kept_whole(model):
    """(bytes every rank holds whole, bytes rank 0 alone holds) of the decoder's copies, from the model's modules:
    the norms (a layer's, its recurrent layer's gated norm, the final one), MoE routers and shared-expert gates; the
    biases of the projections back to the hidden size (o, down, the experts' and the shared expert's down)."""
    whole, first = [], []
    for layer in model.model.layers:
        for name, m in layer.named_children():
            if name.endswith("norm"):
                whole.append(m.weight)
        a, mlp = getattr(layer, "self_attn", None), layer.mlp
        if a is not None:
            first.append(a.o_proj.bias)
        rec = getattr(layer, "linear_attn", None)
        if rec is not None:
            whole.append(rec.norm.weight)
        if transformer.is_moe(mlp):
            router = getattr(mlp, "gate", None) or getattr(mlp, "router", None)
            whole += [router.weight, getattr(router, "bias", None)]
            first.append(getattr(mlp.experts, "down_proj_bias", None))
            gate = getattr(mlp, "shared_expert_gate", None)
            if gate is not None:
                whole += [gate.weight, gate.bias]
                first.append(mlp.shared_expert.down_proj.bias)
        else:
            first.append(mlp.down_proj.bias)
    whole.append(model.model.norm.weight)
    return bytes_of(whole), bytes_of(first)


def in_place(model):
    """Bytes the whole decoder reads from the model in place instead of copying: its MoE blocks'."""
    return sum(bytes_of(layer.mlp.parameters()) for layer in model.model.layers if transformer.is_moe(layer.mlp))


def respond(vocab):
    """An environment that answers every turn with 1-3 tokens fixed by the row and its turn count."""
    def answer(turns):
        return [[(7 * t.row + len(t.ids) + j) % vocab for j in range(1 + t.row % 3)] for t in turns]
    return answer


def export(out_path, rank, world):
    """Tied (Qwen2), untied (Llama, LoRA on every projection) and Qwen3-MoE (LoRA on its experts too; 6 experts over
    4 ranks, so the last rank's shard is empty), each fully_shard-ed over the 4 processes and exported in files of at
    most 20 kB; rank 0 writes {family: the folder, the merged whole weights' file} to `out_path`-export.json."""
    import tempfile

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from layers import lora
    from runs import export as run_export
    mesh = init_device_mesh("cpu", (world,))
    folder = tempfile.mkdtemp(prefix="export", dir=os.path.dirname(out_path)) if rank == 0 else None
    saved = {}
    for family, overrides, targets in (("qwen2", {}, None), ("llama", {}, "all"),
                                       ("qwen3_moe", {"num_experts": 6}, "all")):
        model, tok = architectures.tiny(family, **overrides)
        if targets:
            architectures.adapt(model, 4, targets)
        want = lora.merge_lora_state_dict(model)  # the whole model's merged weights, as one process exports them
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        path = f"{folder}/{family}" if rank == 0 else None
        run_export.export_model(model, tok, path, master=rank == 0, max_shard_bytes=20_000)
        if rank == 0:
            torch.save(want, f"{folder}/{family}.pt")
            saved[family] = [path, f"{folder}/{family}.pt"]
    if rank == 0:
        with open(f"{out_path}-export.json", "w") as f:
            json.dump(saved, f)


# FSDP2-sharded models, LoRA on every layer they adapt, whose slices are cut from the shards (`sharded_copies`): family
# -> (settings, dtypes). At the tests' default of 2 K/V heads, T = 4 holds each K/V head on two ranks
SHARDED = {
    # biases on q/k/v, o and the MLP; LoRA on each projection; bf16 by FSDP2's mixed precision too
    "llama": ({}, (torch.float32, torch.bfloat16)),
    "qwen3_moe": ({}, (torch.float32,)),  # LoRA on the fused experts too
    "gpt_oss": ({}, (torch.float32,)),  # interleaved gate/up, expert biases, sinks
    "qwen2_moe": ({}, (torch.float32,)),  # a shared expert and its gate
    # a gated query and a Gated DeltaNet layer
    "qwen3_5": (dict(architectures.FAMILIES["qwen3_5"].tp, num_hidden_layers=2,
                     layer_types=["linear_attention", "full_attention"]), (torch.float32,)),
}


class Materialized(TorchDispatchMode):
    """What the ops run under it allocate: every new plain tensor (an op's return that aliases none of its inputs),
    its bytes by `where` (a layer's index, or "root"). A DTensor is the global view of a shard, not memory: its
    local tensor is what counts."""

    def __init__(self):
        super().__init__()
        self.where, self.made = None, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = out if isinstance(out, (tuple, list)) else [out]
        for ret, t in zip(func._schema.returns, returns):
            if ret.alias_info is None and type(t) is torch.Tensor:
                self.made.append((self.where, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return out


def copies(dec):
    """name -> each tensor of a decoder's weight copies: its layers' (a MoE block's share, a recurrent layer's), the
    root's."""
    out = {f"root.{k}": v for k, v in dec.w[1].items()}
    for i, d in enumerate(dec.w[0]):
        for k, v in d.items():
            out.update({f"{i}.moe.{n}": t for n, t in v.held.items()} if k == "moe" else {f"{i}.{k}": v})
    for i, r in dec.recurrent.items():
        for k, v in r.w.items():
            pairs = enumerate(v) if isinstance(v, tuple) else [(None, v)]
            out.update({f"{i}.rec.{k}" + ("" if j is None else f".{j}"): t for j, t in pairs})
    return out


def sharded_copies(rank, world, groups):
    """For each model of `SHARDED`, fully_shard-ed over the 4 processes (float32 master weights; bf16 by FSDP2's
    mixed precision where listed), each group's decoder loaded from the shards: the names of the copies that differ
    (bits, dtype) from those of the same group's decoder loaded from the whole model in that dtype, and the bytes of
    every tensor the load allocates, with the whole layers' and the embedding's for scale."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from layers import engine, transformer
    mesh = init_device_mesh("cpu", (world,))
    lines = []
    for family, (settings, dtypes) in SHARDED.items():
        model, _ = architectures.tiny(family, **settings)
        architectures.adapt(model, 4, "all")
        for dtype in dtypes:
            whole = copy.deepcopy(model).to(dtype)  # what FSDP2's gather gives each layer, in the decoder's dtype
            sharded = copy.deepcopy(model)
            mp = MixedPrecisionPolicy(param_dtype=dtype if dtype != torch.float32 else None)
            for layer in sharded.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(sharded, mesh=mesh, mp_policy=mp)
            size = dtype.itemsize
            layer_bytes = [sum(p.numel() for p in layer.parameters()) * size for layer in whole.model.layers]
            largest = [max(p.numel() for p in layer.parameters()) * size for layer in whole.model.layers]
            for t, tp in groups.items():
                want = engine.StaticDecoder(whole, 4, 64, tp=tp, dtype=dtype)
                want.load(whole)
                got = engine.StaticDecoder(sharded, 4, 64, tp=tp, dtype=dtype, device=torch.device("cpu"))
                seen = Materialized()
                params, root = transformer.layer_params, engine.StaticDecoder._load_root

                def marked(layer, *args):
                    seen.where = list(sharded.model.layers).index(layer)
                    return params(layer, *args)

                def marked_root(dec, m):
                    seen.where = "root"
                    return root(dec, m)
                transformer.layer_params, engine.StaticDecoder._load_root = marked, marked_root
                try:
                    with seen:
                        got.load(sharded)
                finally:
                    transformer.layer_params, engine.StaticDecoder._load_root = params, root
                a, b = copies(want), copies(got)
                differ = sorted(k for k in a.keys() | b.keys() if (a.get(k) is None) != (b.get(k) is None) or
                                a.get(k) is not None and (a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])))
                kept = {v.untyped_storage().data_ptr() for v in b.values() if v is not None}
                # a recurrent layer's states per row, which its first load allocates with its copies
                kept |= {t.untyped_storage().data_ptr() for r in got.recurrent.values() for t in (r.conv, r.rec)}
                lines.append(dict(family=family, dtype=str(dtype), size=t, rank=rank, differ=differ,
                                  made=[(w, n, ptr in kept) for w, ptr, n in seen.made],
                                  layer_bytes=layer_bytes, largest=largest, vocab=model.config.vocab_size,
                                  embed_bytes=whole.model.embed_tokens.weight.numel() * size))
    return lines


def main(out_path):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {2: Slice(rank % 2, 2, pairs[rank // 2]), 4: Slice(rank, 4, dist.new_group(list(range(world))))}
    lines = []
    for family, settings in FAMILIES.items():
        for variant, extra in (("", DIVIDING), ("kv2", {})):
            if variant and not architectures.FAMILIES[family].tp_kv_copies:
                continue
            model, tok = architectures.tiny(family, **settings, **extra)
            vocab = model.config.vocab_size
            prompts = {"": tok(["The quick brown fox", "hi", "abc def"], return_tensors="pt", padding=True),
                       # a group's prompt prefilled once for its rows (share_prompts)
                       "shared": tok(["hi", "The quick brown fox", "hi"], return_tensors="pt", padding=True)}
            runs = {
                "greedy": dict(temperature=0.0, max_new_tokens=12, eos_ids=[tok.eos_token_id]),
                "sampled": dict(temperature=0.9, max_new_tokens=16, eos_ids=list(range(97, 104)), check_every=4),
                # every 11th token ends a turn; answers of 1-3 tokens, up to 3 turns
                "turns": dict(temperature=1.0, max_new_tokens=20, eos_ids=list(range(0, vocab, 11)), check_every=2,
                              respond=respond(vocab), max_turns=3),
                "top_k": dict(temperature=1.0, top_k=20, max_new_tokens=8, eos_ids=[tok.eos_token_id]),
                # the rows streaming through one place, the next taking it when a row ends
                "streamed": dict(temperature=0.9, max_new_tokens=16, eos_ids=list(range(97, 104)), check_every=4,
                                 in_flight=1),
                "shared": dict(temperature=0.9, max_new_tokens=16, eos_ids=list(range(97, 104)), check_every=4,
                               share_prompts=True),
            }
            for case, kw in runs.items():
                if case not in ("greedy", "turns") and family not in EVERY_CASE:
                    continue
                kw = dict(kw, pad_id=tok.pad_token_id, seeds=torch.tensor([5, 6, 7]), keep_decoder=True)
                enc = prompts.get(case, prompts[""])
                whole = sampler_options.sample(model, enc.input_ids, enc.attention_mask, **kw)
                whole_bytes = model._static_decoder.weight_bytes()
                ref = None
                if case == "greedy":
                    with torch.no_grad():
                        ref = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                                             do_sample=False, max_new_tokens=12, pad_token_id=tok.pad_token_id,
                                             eos_token_id=tok.eos_token_id)[:, enc.input_ids.shape[1]:].tolist()
                for size, tp in groups.items():
                    got = sampler_options.sample(model, enc.input_ids, enc.attention_mask, tp=tp, **kw)
                    mask = whole.policy_mask.bool()
                    diff = (got.logprobs - whole.logprobs)[mask].abs().max().item() if mask.any() else 0.0
                    lines.append(dict(
                        family=family + (f"_{variant}" if variant else ""), case=case, size=size, rank=rank,
                        tp_rank=tp.rank, tokens=got.completion_ids.tolist(), whole_tokens=whole.completion_ids.tolist(),
                        mask=got.completion_mask.tolist(), whole_mask=whole.completion_mask.tolist(),
                        policy=got.policy_mask.tolist(), whole_policy=whole.policy_mask.tolist(),
                        turns=whole.turns.tolist(), logprob_diff=diff, generate=ref,
                        bytes=model._static_decoder.weight_bytes(), whole_bytes=whole_bytes,
                        kept_whole=kept_whole(model), in_place=in_place(model), vocab_rows=model._static_decoder.vocab_span,
                        hidden=model.config.hidden_size, tied=model.config.tie_word_embeddings,
                        element=model.lm_head.weight.element_size()))
                    model.__dict__.pop("_static_decoder", None)
                model.__dict__.pop("_static_decoder", None)
    with open(f"{out_path}.{rank}", "w") as f:
        f.write("\n".join(json.dumps(x) for x in lines))
    with open(f"{out_path}-sharded.{rank}", "w") as f:
        f.write("\n".join(json.dumps(x) for x in sharded_copies(rank, world, groups)))
    export(out_path, rank, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
