"""The bench's shared row: the training phase with each group's prompt computed once (--shared_prompts) against the
padded rows, each computing its prompt again (today's forward).

A group of G completions of one long prompt (512 tokens, 128-token completions, G = 8 on either device), every
completion token counted: the forward and backward of one micro-batch set (`logprobs.micro_batches`, then
`completion_logprobs`, `grpo_loss` and backward per micro-batch, as train.backward_mini_batch runs them), on the
written-out layers (the bench model's path) and on the model's own forward (the MoE families' path). Reported: the
time of each (median of alternated runs), on CUDA the peak memory above what was held before, and the bytes of the
tensors kept for backward (the largest micro-batch's, parameters aside: exact on any device), the positions the forward
computes (G(P + C - 1) padded, P + G(C - 1) shared: a completion's last token predicts nothing), and the log-probs'
largest difference. Also the attention alone, per layer
shape, as the choice of mask implementation was made: SDPA causal over the padded rows, SDPA with one boolean tree mask
over the packed sequence, the two-part SDPA the written-out layers use (transformer.Tree), and FlexAttention where
it runs forward and backward on this device.
"""

import statistics

import torch
import torch.nn.functional as F

import grpo
import logprobs
import model_loading
from bench.common import load, medians
from bench.step import MEMORY_METHOD, peak_bytes


def groups_batch(s, vocab, device):
    """(ids, mask, loss mask, prompt ids): sh_prompts groups of sh_generations rows, random tokens, every completion
    token counted."""
    g = torch.Generator().manual_seed(0)
    n, p, t = s["sh_prompts"] * s["sh_generations"], s["sh_prompt_len"], s["sh_completion_len"]
    prompts = torch.randint(3, vocab, (s["sh_prompts"], p), generator=g).repeat_interleave(s["sh_generations"], 0)
    ids = torch.cat([prompts, torch.randint(3, vocab, (n, t), generator=g)], 1).to(device)
    mask = torch.ones_like(ids)
    return ids, mask, torch.ones(n, t, device=device), ids[:, :p]


def training_phase(model, ids, mask, loss_mask, micro, t, written_out, saved=None):
    """One micro-batch set's forward and backward; the (N, T) log-probs. `saved` (a list): each micro-batch's bytes
    of tensors kept for backward, the model's parameters aside, appended."""
    n = ids.shape[0]
    adv = torch.linspace(-1, 1, n, device=ids.device)
    out = torch.zeros(loss_mask.shape, device=ids.device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for mb in micro:
        kept = {}

        def keep(x):
            storage = x.untyped_storage()
            if storage.data_ptr() not in params:
                kept[storage.data_ptr()] = storage.nbytes()
            return x
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
            logp, _ = logprobs.completion_logprobs(model, *mb.take(ids, mask), mb.t, fast_forward=written_out,
                                                   width=mb.width)
            loss, _ = grpo.grpo_loss(logp, logp.detach(), None, adv[mb.rows], loss_mask[mb.rows, :mb.t],
                                     grpo.Objective(beta=0.0, max_completion_length=t), num_sequences=n,
                                     num_tokens=loss_mask.sum())
        loss.backward()
        out[mb.rows, :mb.t] = logp.detach()
        if saved is not None:
            saved.append(sum(kept.values()))
    model.zero_grad(set_to_none=True)
    return out


def positions(ids, mask, micro):
    """The positions a micro-batch set's forward computes: rows x width padded, each tree's sequences shared."""
    total = 0
    for mb in micro:
        if isinstance(mb.width, logprobs.SharedPrompts):
            total += logprobs.pack(*mb.take(ids, mask), mb.t, mb.width.completion).positions_computed()
        else:
            total += len(mb.rows) * mb.width
    return total


def attention_alone(s, model, device):
    """Forward and backward of one layer's attention at the row's shapes (the model's heads and head size), in ms:
    causal SDPA over the G padded rows, one SDPA with the (L, L) boolean tree mask, the two-part SDPA, FlexAttention."""
    cfg = model.config
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    p, c, g = s["sh_prompt_len"], s["sh_completion_len"] - 1, s["sh_generations"]
    dtype = getattr(torch, s["dtype"])
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()
    q, k, v = rand(g, heads, p + c, hd), rand(g, kv, p + c, hd), rand(g, kv, p + c, hd)
    length = p + g * c
    qt, kt, vt = rand(1, heads, length, hd), rand(1, kv, length, hd), rand(1, kv, length, hd)
    seg = torch.cat([torch.full((p,), -1), torch.arange(g).repeat_interleave(c)]).to(device)
    i = torch.arange(length, device=device)
    tree = (i[None] <= i[:, None]) & ((seg[None] == -1) | (seg[None] == seg[:, None]))
    qp, kp, vp = rand(1, heads, p, hd), rand(1, kv, p, hd), rand(1, kv, p, hd)
    qb, kb, vb = rand(g, heads, c, hd), rand(g, kv, c, hd), rand(g, kv, c, hd)
    branch = torch.cat([torch.ones(c, p, dtype=torch.bool), torch.ones(c, c, dtype=torch.bool).tril()], 1).to(device)

    def padded():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    def one_mask():
        F.scaled_dot_product_attention(qt, kt, vt, attn_mask=tree, enable_gqa=True).sum().backward()

    def two_part():
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        keys, values = torch.cat([kp.expand(g, -1, -1, -1), kb], 2), torch.cat([vp.expand(g, -1, -1, -1), vb], 2)
        (o.sum() + F.scaled_dot_product_attention(qb, keys, values, attn_mask=branch, enable_gqa=True).sum()).backward()
    runs = {"padded causal": padded, "one tree mask": one_mask, "two-part": two_part}
    flex_error = None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def tree_mod(b, h, qi, ki):
            return (ki <= qi) & ((seg[ki] == -1) | (seg[ki] == seg[qi]))
        block = create_block_mask(tree_mod, 1, 1, length, length, device=str(device))
        compiled = torch.compile(flex_attention)

        def flex():
            compiled(qt, kt, vt, block_mask=block, enable_gqa=True).sum().backward()
        flex()
        runs["flex"] = flex
    except Exception as e:  # noqa: BLE001 (any failure is reported, not raised: on CPU its backward is missing)
        flex_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    med = medians(runs, s, device)
    return {k: v * 1e3 for k, v in med.items()}, flex_error


def prefill(model, prompt_ids, s, device):
    """The sampler's prefill of the group's rows (`StaticDecoder.prefill`), each row's prompt run vs each distinct
    prompt run once and its cache copied to its rows (share); the first logits' largest difference."""
    from layers import shared_prefill
    from layers.engine import StaticDecoder
    model = model.eval()
    n, p = prompt_ids.shape
    dec = StaticDecoder.for_model(model, n, p + s["sh_completion_len"] + 1, cuda_graph=False)
    attn = torch.ones_like(prompt_ids)
    positions = logprobs.position_ids_from_mask(attn)
    runs = {"rows": lambda: dec.prefill(prompt_ids, attn, positions),
            "shared": lambda: shared_prefill.prefill(dec, prompt_ids, attn, positions)}
    diff = (runs["rows"]() - runs["shared"]()).abs().max().item()
    med = medians(runs, s, device)
    model.__dict__.pop("_static_decoder", None)
    model.train()
    return {"shared_prefill_rows_s": med["rows"], "shared_prefill_shared_s": med["shared"],
            "shared_prefill_speedup": med["rows"] / med["shared"], "shared_prefill_logits_max_diff": diff}


def varied_batch(s, vocab, device, groups, share=True):
    """(ids, mask, loss mask, prompt ids): `groups` groups of sh_generations rows whose prompts (from a quarter of
    sh_prompt_len to all of it) and counted completions (from an eighth of sh_completion_len to all of it) differ in
    length, left-padded; share=False: every row its own prompt (rows that share nothing)."""
    g = torch.Generator().manual_seed(1)
    p, t, rows = s["sh_prompt_len"], s["sh_completion_len"], s["sh_generations"]
    n = groups * rows
    lengths = torch.linspace(p // 4, p, groups).long().repeat_interleave(rows)
    ids = torch.randint(3, vocab, (n, p + t), generator=g)
    if share:
        ids[:, :p] = ids[::rows, :p].repeat_interleave(rows, 0)
    mask = (torch.arange(p + t)[None] >= p - lengths[:, None]).long()
    ids = ids * mask
    counted = torch.randint(t // 8, t + 1, (n,), generator=g)
    loss_mask = (torch.arange(t)[None] < counted[:, None]).float()
    return ids.to(device), mask.to(device), loss_mask.to(device), ids[:, :p].to(device)


def packing(model, s, vocab, device):
    """The written-out layers' training phase over micro-batches of two groups whose trees differ in length: the
    trees back to back in one row (`pack(flat=True)`, what they take) against each tree a row padded to the longest
    (flat=False), and the padded rows; then rows that share no prompt, each its own tree back to back, against the
    padded rows. Seconds (median of alternated runs) and positions computed."""
    t, out, pack = s["sh_completion_len"], {}, logprobs.pack
    for name, share in (("groups", True), ("rows", False)):
        ids, mask, loss_mask, prompt_ids = varied_batch(s, vocab, device, 4, share)
        size = 2 * s["sh_generations"]
        padded = logprobs.micro_batches(mask, loss_mask, t, size)
        trees = logprobs.shared_micro_batches(mask, loss_mask, t, size, prompt_ids=prompt_ids)

        def tree_run(flat):
            def run():
                logprobs.pack = lambda *a, **kw: pack(*a, **{**kw, "flat": flat})
                try:
                    return training_phase(model, ids, mask, loss_mask, trees, t, True)
                finally:
                    logprobs.pack = pack
            return run
        runs = {"padded rows": lambda: training_phase(model, ids, mask, loss_mask, padded, t, True),
                "trees back to back": tree_run(True), "trees padded": tree_run(False)}
        logp = {k: fn() for k, fn in runs.items()}
        med = medians(runs, s, device)
        out[f"shared_packing_{name}_s"] = med
        out[f"shared_packing_{name}_positions"] = {
            "padded rows": positions(ids, mask, padded),
            "trees back to back": sum(pack(*mb.take(ids, mask), mb.t, mb.width.completion, flat=True)
                                      .positions_computed() for mb in trees),
            "trees padded": positions(ids, mask, trees)}
        out[f"shared_packing_{name}_logprob_max_diff"] = max(
            ((logp[k] - logp["padded rows"]) * loss_mask).abs().max().item() for k in logp)
    return out


SHARED_FAMILIES = ("qwen3", "qwen3_moe", "gpt_oss", "qwen3_5")  # one per path: see `families`


def families(s, device):
    """The training phase of the row's group, padded and shared, on a random model of a family per path of
    tests/architectures.py (the tests' configs, hidden 64): Qwen3 (the written-out layers), Qwen3-MoE (its own
    forward, sdpa), gpt-oss (its own forward, eager attention with sinks and a window) and Qwen3.5 (its own forward;
    Gated DeltaNet layers forked at the prompt's end). {family: {padded_s, shared_s, speedup, logprob_max_diff}}."""
    import os
    import sys
    tests_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    import architectures
    from layers import transformer
    out, t = {}, s["sh_completion_len"]
    for name in SHARED_FAMILIES:
        model, tok = architectures.tiny(name)
        model.to(device=device, dtype=getattr(torch, s["dtype"])).train()
        written_out = transformer.decide(model).trains_written_out(model)
        ids, mask, loss_mask, prompt_ids = groups_batch(s, len(tok), device)
        size = s["sh_micro_batch"]
        micro = {"padded": logprobs.micro_batches(mask, loss_mask, t, size),
                 "shared": logprobs.shared_micro_batches(mask, loss_mask, t, size, prompt_ids=prompt_ids)}
        runs = {k: (lambda m=m: training_phase(model, ids, mask, loss_mask, m, t, written_out))
                for k, m in micro.items()}
        diff = (runs["padded"]() - runs["shared"]()).abs().max().item()
        med = medians(runs, s, device)
        out[name] = {"padded_s": med["padded"], "shared_s": med["shared"], "speedup": med["padded"] / med["shared"],
                     "logprob_max_diff": diff, "path": "written-out" if written_out else "own forward"}
    return out


def bench_shared(path, s, device):
    tokenizer = model_loading.load_tokenizer(path)
    model = load(path, s, device).train()
    ids, mask, loss_mask, prompt_ids = groups_batch(s, len(tokenizer), device)
    t = s["sh_completion_len"]
    micro = {"padded": logprobs.micro_batches(mask, loss_mask, t, s["sh_micro_batch"]),
             "shared": logprobs.shared_micro_batches(mask, loss_mask, t, s["sh_micro_batch"], prompt_ids=prompt_ids)}
    out = {"shared_positions_padded": positions(ids, mask, micro["padded"]),
           "shared_positions_shared": positions(ids, mask, micro["shared"])}
    out["shared_positions_ratio"] = out["shared_positions_padded"] / out["shared_positions_shared"]
    for path_name, written_out in (("written_out", True), ("own_forward", False)):
        runs = {k: (lambda m=m: training_phase(model, ids, mask, loss_mask, m, t, written_out))
                for k, m in micro.items()}
        saved = {k: [] for k in micro}
        a, b = (training_phase(model, ids, mask, loss_mask, m, t, written_out, saved[k]) for k, m in micro.items())
        out[f"shared_{path_name}_logprob_max_diff"] = (a - b).abs().max().item()
        out[f"shared_{path_name}_padded_saved_bytes"] = max(saved["padded"])
        out[f"shared_{path_name}_shared_saved_bytes"] = max(saved["shared"])
        out[f"shared_{path_name}_saved_ratio"] = max(saved["shared"]) / max(saved["padded"])
        med = medians(runs, s, device)
        out.update({f"shared_{path_name}_padded_s": med["padded"], f"shared_{path_name}_shared_s": med["shared"],
                    f"shared_{path_name}_speedup": med["padded"] / med["shared"]})
        if device.type == "cuda":  # on a CPU the resident set keeps what the run before freed: not measurable here
            peaks = {k: statistics.median(peak_bytes(fn, device) for _ in range(2)) for k, fn in runs.items()}
            out.update({f"shared_{path_name}_padded_peak_bytes": peaks["padded"],
                        f"shared_{path_name}_shared_peak_bytes": peaks["shared"],
                        f"shared_{path_name}_memory_ratio": peaks["shared"] / peaks["padded"]})
    out.update(packing(model, s, len(tokenizer), device))
    out["shared_families"] = families(s, device)
    out.update(prefill(model, prompt_ids, s, device))
    attention, flex_error = attention_alone(s, model, device)
    out["shared_attention_ms"] = attention
    out["shared_flex_error"] = flex_error
    out["shared_memory_method"] = (MEMORY_METHOD["cuda"] if device.type == "cuda" else "no peak on a CPU (the "
                                   "resident set keeps what the previous run freed); tensors kept for backward only")
    return out
