"""Shared prefill (--shared_prompts on the fast decoder): rows with the same prompt (a group's G completions) run it
once, and its K/V, recurrent states and routing records are copied to each of them.

The prefill's compute falls by the group size; the cache holds the G copies as before (a row's slots stay its own
to decode into). The features' steps (features/sampler_options.py's _SharedSteps) call `prefill` in place of the
decoder's. The decoder (layers/engine.py) prefills the distinct prompts into its first rows, as it prefills
any batch, and each row of the batch then takes its prompt's row: cache slots, key mask, rotary tables and window
positions, routing records, recurrent states.
"""

import torch


@torch.no_grad()
def prefill(dec, ids, attn, positions):
    """StaticDecoder.prefill of the rows ids, attn (N, P) with their positions, each distinct prompt run once: the
    last position's logits (N, V)."""
    n, p = ids.shape
    distinct, inverse = torch.unique(torch.cat([ids, attn.long()], 1), dim=0, return_inverse=True)
    if distinct.shape[0] == n:  # every prompt its own
        return dec.prefill(ids, attn, positions)
    # the distinct prompts run, in torch.unique's order, in rows [0, m); row i's prompt is inverse[i]
    ids, attn = distinct[:, :p], distinct[:, p:]
    logits = dec.prefill(ids, attn, (attn.cumsum(-1) - 1).clamp(min=0))  # as logprobs.position_ids_from_mask
    for buf in (dec.k_cache, dec.v_cache):
        for i in range(buf.shape[0]):  # a layer at a time: the gather's copy is one layer's prompt cache
            buf[i, :n, :, :p] = buf[i, inverse, :, :p]
    for buf in (dec.key_mask, *dec.cos, *dec.sin, *([] if dec.windows is None else [dec.windows.pos])):
        buf[:n] = buf[inverse]
    if dec.recorder is not None:
        dec.recorder.routes[:n, :p] = dec.recorder.routes[inverse, :p]
    for layer in dec.recurrent.values():
        layer.compact(inverse)  # rows [0, N) take their prompt's states
    return logits[inverse]
