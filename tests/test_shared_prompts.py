"""--shared_prompts: a group's prompt computed once in the training forward gives what the padded forward gives.

Every comparison runs a batch of groups (G completions of one prompt, prompts of different lengths, left-padded)
through `logprobs.micro_batches` and `completion_logprobs` twice, as train.update and backward_mini_batch do: once
padded (each row its own prompt), once with prompts shared (`shared_micro_batches`: a tree per prompt).
The log-probs, entropies, loss and every gradient must agree within float32 rounding, for each family path (the
written-out layers' two-part tree attention, the model's own forward with a tree mask, Qwen3.5's Gated DeltaNet
layers forking their states at each prompt's end), every loss type, GSPO, an entropy bonus, the k3 KL to a reference, LoRA, and completions with an
environment's tokens inside. The tests' models (tests/architectures.py) have weights large enough that attention is
sharp: a mask that lets a branch see another branch, or a branch's recurrent state not taken from its prompt, moves the
log-probs far past the tolerance, which tests show.
"""

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpo  # noqa: E402
import logprobs  # noqa: E402
from layers import static_recurrent, transformer  # noqa: E402
import architectures  # noqa: E402
from features import routing_replay  # noqa: E402

T = 7                     # completion columns
PROMPTS = (5, 9, 9)       # prompt lengths (left-padded to the longest): one short prompt, two long ones
G = 3                     # completions per prompt
COUNTED = (7, 3, 0, 6, 7, 1, 5, 2, 7)  # each row's completion tokens up to its last counted one (0: none)


def batch(seed=0, distinct=False):
    """(ids, mask, loss_mask, prompt_ids): len(PROMPTS) groups of G rows, left-padded prompts then T completion tokens;
    the loss mask counts each row's first COUNTED tokens, less an environment's answer (tokens 2-3) inside the longer
    ones: a second turn of the policy after it. `distinct`: each row's last prompt token its own (no row shares)."""
    g = torch.Generator().manual_seed(seed)
    p = max(PROMPTS)
    ids, mask = [], []
    for n in PROMPTS:
        prompt = torch.randint(3, 250, (n,), generator=g)
        for _ in range(G):
            completion = torch.randint(3, 250, (T,), generator=g)
            ids.append(torch.cat([torch.zeros(p - n, dtype=torch.long), prompt, completion]))
            mask.append(torch.cat([torch.zeros(p - n), torch.ones(n + T)]))
    ids, mask = torch.stack(ids), torch.stack(mask).long()
    if distinct:
        ids[:, p - 1] = torch.arange(3, 3 + ids.shape[0])
    counted = torch.arange(T)[None] < torch.tensor(COUNTED)[:, None]
    environment = (torch.arange(T)[None] >= 2) & (torch.arange(T)[None] < 4) & (torch.tensor(COUNTED)[:, None] > 4)
    return ids, mask, (counted & ~environment).float(), ids[:, :p]


def micro_batches(mask, loss_mask, T, size, max_tokens=0, prompt_ids=None):
    """logprobs' micro-batches: a tree per prompt where `prompt_ids` are given (--shared_prompts), else padded rows."""
    if prompt_ids is None:
        return logprobs.micro_batches(mask, loss_mask, T, size, max_tokens)
    return logprobs.shared_micro_batches(mask, loss_mask, T, size, max_tokens, prompt_ids=prompt_ids)


def run(model, shared, objective=None, size=16, max_tokens=0, entropy_grad=False, ref=None, old=None, seed=0,
        grad=True, distinct=False):
    """The step's micro-batched forward and backward as train.backward_mini_batch runs it: per-token log-probs and
    entropies (N, T), zero where not counted, the loss summed over micro-batches, each parameter's gradient, and the
    micro-batches."""
    ids, mask, loss_mask, prompt_ids = batch(seed, distinct)
    n = ids.shape[0]
    adv = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    micro = micro_batches(mask, loss_mask, T, size, max_tokens, prompt_ids=prompt_ids if shared else None)
    model.zero_grad(set_to_none=True)
    logp_all, ent_all, total = torch.zeros(n, T), torch.zeros(n, T), 0.0
    for mb in micro:
        with torch.set_grad_enabled(grad):
            logp, ent = logprobs.completion_logprobs(model, *mb.take(ids, mask), mb.t, 0.9, width=mb.width,
                                                     entropy_grad=entropy_grad)
        m = loss_mask[mb.rows, :mb.t]
        logp_all[mb.rows, :mb.t], ent_all[mb.rows, :mb.t] = logp.detach() * m, ent.detach() * m
        if objective is not None:
            loss, _ = grpo.grpo_loss(logp, old[mb.rows, :mb.t], None if ref is None else ref[mb.rows, :mb.t],
                                     adv[mb.rows], m, objective, num_sequences=n, num_tokens=loss_mask.sum(),
                                     entropy=ent)
            loss.backward()
            total += loss.detach()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return logp_all, ent_all, total, grads, micro


def assert_same(a, b, spread=None):
    """Two `run`s agree: log-probs, entropies and loss within 1e-5 relative, each gradient within 1e-5 of its
    largest entry (float32 rounding of sums over a few hundred positions, summed in another order). `spread`: `b`
    computed again by other float32 arithmetic; a gradient may then differ by twice as much as it differs from `b`,
    where that is more."""
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.as_tensor(a[2]), torch.as_tensor(b[2]), rtol=1e-5, atol=1e-7)
    assert a[3].keys() == b[3].keys()
    for k, g in b[3].items():
        atol = 1e-5 * g.abs().max().item()
        if spread is not None:
            atol = max(atol, 2 * (spread[3][k] - g).abs().max().item())
        torch.testing.assert_close(a[3][k], g, rtol=1e-5, atol=atol, msg=k)


def old_and_ref(model):
    """pi_old (the padded log-probs, moved so that some ratios clip) and a reference's log-probs (another model)."""
    logp = run(model, False, grad=False)[0]
    old = logp + torch.randn(logp.shape, generator=torch.Generator().manual_seed(5)) * 0.3
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    return old, run(reference, False, grad=False)[0], reference


@pytest.fixture
def packs(monkeypatch):
    """The trees `logprobs.pack` built in the test (none: the padded forward ran)."""
    seen = []
    pack = logprobs.pack

    def spy(*args, **kwargs):
        seen.append(pack(*args, **kwargs))
        return seen[-1]
    monkeypatch.setattr(logprobs, "pack", spy)
    return seen


# each family of the tests' table and its path: the written-out layers (windows, softcaps, head norms, offsets, scaled
# embeddings, layers without rotary), or the model's own forward with a tree mask (MoE: sdpa; gpt-oss: eager, sinks,
# windows on one layer type; Qwen3.5: a gated query, and Gated DeltaNet layers that fork their states)
FAMILIES = {**{n: "written-out" for n in architectures.TRAINED_WRITTEN_OUT},
            **{n: "own forward" for n, r in architectures.FAMILIES.items() if r.layers in ("moe", "hybrid")}}


def token_by_token(monkeypatch):
    """Qwen3.5's Gated DeltaNet layers on the delta rule a token at a time (transformers' recurrent form) in place of
    the chunked form their forward calls. The chunked form rounds in float32 by chunks of 64 tokens, so a branch
    started from its prompt's state rounds otherwise than its row in one pass (about 2e-5 of the largest entry in the
    decay parameters' gradients, as much as the chunked and the recurrent forms differ over the padded rows); a
    token at a time, the tree and the padded rows run the same arithmetic per token, and agree as the other
    families do."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    recurrent = modeling_qwen3_5.torch_recurrent_gated_delta_rule
    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule",
                        lambda *args, chunk_size=None, **kwargs: recurrent(*args, **kwargs))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_prompts_equal_the_padded_forward(family, packs, monkeypatch):
    """Log-probs, entropies, a GRPO loss with the k3 KL and every gradient, with and without shared prompts; the
    tree holds each prompt once, and fewer positions than the padded rows."""
    model, _ = architectures.tiny(family)
    model.train()
    path = FAMILIES[family]
    assert transformer.decide(model).trains_written_out(model) == (path == "written-out")
    if transformer.recurrent_modules(model):
        token_by_token(monkeypatch)
    old, ref, _ = old_and_ref(model)
    objective = grpo.Objective(beta=0.04, epsilon=0.2, max_completion_length=T)
    padded = run(model, False, objective, old=old, ref=ref)
    assert not packs
    shared = run(model, True, objective, old=old, ref=ref)
    assert_same(shared, padded)
    tree = packs[0]
    assert tree.tree.prompt.shape[0] == len(PROMPTS)  # one sequence per prompt
    assert (tree.segment == -1).sum() == sum(PROMPTS)
    rows = sum(len(mb.rows) for mb in padded[4])
    assert tree.positions_computed() < rows * padded[4][0].width
    # the written-out layers take the sequences back to back in one row, the own forward one row each
    assert tree.ids.shape[0] == (1 if path == "written-out" else len(PROMPTS))
    assert tree.real.all() == (path == "written-out")


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_rows_that_share_no_prompt_run_back_to_back(family, packs):
    """Rows whose prompts all differ (each its own tree: a prompt and one branch) run back to back in one row on the
    written-out layers, without padding, positions restarting at each row, and give the padded rows' log-probs and
    gradients."""
    model, _ = architectures.tiny(family)
    model.train()
    objective = grpo.Objective(beta=0.0, epsilon=0.2, max_completion_length=T)
    old = run(model, False, grad=False, distinct=True)[0]
    padded, shared = (run(model, s, objective, old=old, distinct=True) for s in (False, True))
    assert_same(shared, padded)
    tree = packs[0]
    assert tree.tree.prompt.shape[0] == len(COUNTED) and tree.ids.shape[0] == 1 and tree.real.all()
    assert tree.positions_computed() == sum(PROMPTS[i // G] + max(0, c - 1) for i, c in enumerate(COUNTED))
    assert (tree.positions == 0).sum() == len(COUNTED)  # each row's positions from 0


@pytest.mark.parametrize("family", architectures.TRAINED_WRITTEN_OUT)
def test_the_own_forward_takes_the_tree_on_dense_families_too(family, packs):
    """A dense family trains on its own forward where the written-out layers do not apply (in training mode with
    attention dropout): its forward takes the tree's 4-D mask (a mapping by layer type where windows differ) and
    gives the padded log-probs."""
    model, _ = architectures.tiny(family)
    assert transformer.tree_refusal(model) is None
    ids, mask, loss_mask, prompt_ids = batch()
    out = []
    for shared in (False, True):
        (mb,) = micro_batches(mask, loss_mask, T, 16, prompt_ids=prompt_ids if shared else None)
        with torch.no_grad():
            logp = logprobs.completion_logprobs(model, *mb.take(ids, mask), mb.t, fast_forward=False,
                                                width=mb.width)[0]
        out.append(torch.zeros(loss_mask.shape).index_put((mb.rows,), logp * loss_mask[mb.rows, :mb.t]))
    assert len(packs) == 1
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "qwen3_5"])
def test_activation_checkpointing(family, packs, monkeypatch):
    """With each layer recomputed in backward (the tree's masks passed through the checkpoint), on the written-out
    layers and the own forward (Qwen3.5's Gated DeltaNet layers forking again): the gradients of the padded forward
    without it."""
    import model_loading
    model, _ = architectures.tiny(family)
    model.train()
    if family == "qwen3_5":
        token_by_token(monkeypatch)
    old, ref, _ = old_and_ref(model)
    objective = grpo.Objective(beta=0.04, epsilon=0.2, max_completion_length=T)
    padded = run(model, False, objective, old=old, ref=ref)
    model_loading.enable_checkpointing(model)
    assert_same(run(model, True, objective, old=old, ref=ref), padded)
    assert packs


def test_qwen3_5_on_its_chunked_rule(packs, monkeypatch):
    """Qwen3.5 on the chunked delta rule its forward calls: log-probs, entropies and the loss within 1e-5; each
    gradient within 1e-5 of its largest entry, or twice what the padded rows' own gradient moves by on the rule a
    token at a time, where that is more (the chunked form's float32 rounding: `token_by_token`)."""
    model, _ = architectures.tiny("qwen3_5")
    model.train()
    old, ref, _ = old_and_ref(model)
    objective = grpo.Objective(beta=0.04, epsilon=0.2, max_completion_length=T)
    padded, shared = run(model, False, objective, old=old, ref=ref), run(model, True, objective, old=old, ref=ref)
    token_by_token(monkeypatch)
    assert_same(shared, padded, spread=run(model, False, objective, old=old, ref=ref))
    assert packs


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_every_loss_type(loss_type):
    model, _ = architectures.tiny("qwen3")
    old, ref, _ = old_and_ref(model)
    objective = grpo.Objective(loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=0.28,
                               max_completion_length=T)
    assert_same(run(model, True, objective, old=old, ref=ref), run(model, False, objective, old=old, ref=ref))


@pytest.mark.parametrize("case", ["gspo", "entropy bonus", "bias-corrected kl"])
def test_sequence_ratio_entropy_and_kl(case):
    """GSPO's sequence-level ratio (a sum over each row's tokens), an entropy bonus (the entropy's own gradient),
    the k3 KL times the ratio."""
    model, _ = architectures.tiny("gemma3")
    old, ref, _ = old_and_ref(model)
    objective = grpo.Objective(beta=0.1, epsilon=0.2, max_completion_length=T,
                               importance_sampling_level="sequence" if case == "gspo" else "token",
                               entropy_coef=0.05 if case == "entropy bonus" else 0.0,
                               use_bias_correction_kl=case == "bias-corrected kl")
    kw = dict(old=old, ref=ref, entropy_grad=case == "entropy bonus")
    assert_same(run(model, True, objective, **kw), run(model, False, objective, **kw))


def test_reference_logprobs_through_the_tree():
    """The reference's log-probs (no gradient, another model) are the same through the tree."""
    model, _ = architectures.tiny("qwen3")
    _, ref, reference = old_and_ref(model)
    torch.testing.assert_close(run(reference, True, grad=False)[0], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_5"])
def test_lora(family, monkeypatch):
    """LoRA adapters on every projection (experts and Gated DeltaNet layers included): the adapters' gradients, the
    frozen weights without."""
    model, _ = architectures.tiny(family)
    if family == "qwen3_5":
        token_by_token(monkeypatch)
    architectures.adapt(model, 4, "all")
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    old, ref, _ = old_and_ref(model)
    objective = grpo.Objective(beta=0.04, epsilon=0.2, max_completion_length=T)
    shared, padded = run(model, True, objective, old=old, ref=ref), run(model, False, objective, old=old, ref=ref)
    assert padded[3] and all("lora_" in k for k in padded[3])
    assert_same(shared, padded)


@pytest.mark.parametrize("split", [dict(size=1), dict(size=2), dict(size=3), dict(size=6), dict(max_tokens=30),
                                   dict(max_tokens=1)])
def test_any_split_into_micro_batches_gives_the_same_gradient(split):
    """However the rows are cut into micro-batches (a group apart, or several groups in one), the gradient is the
    whole batch's padded one; a micro-batch keeps a group's rows together where it can, and a token budget counts
    the positions its tree computes."""
    model, _ = architectures.tiny("qwen3")
    old, ref, _ = old_and_ref(model)
    objective = grpo.Objective(beta=0.04, epsilon=0.2, max_completion_length=T)
    shared = run(model, True, objective, old=old, ref=ref, **split)
    assert_same(shared, run(model, False, objective, old=old, ref=ref))
    micro = shared[4]
    if "size" in split:
        assert len(micro) == -(-len(COUNTED) // split["size"])  # as many forwards as without sharing
    ids, mask, _, prompt_ids = batch()
    if "size" in split:  # a group in as few micro-batches as its rows need, one more where it straddles a cut
        for first in range(0, len(COUNTED), G):
            holding = [i for i, mb in enumerate(micro) if set(mb.rows.tolist()) & set(range(first, first + G))]
            assert holding == list(range(holding[0], holding[-1] + 1))
            assert len(holding) <= -(-G // split["size"]) + (split["size"] % G != 0)
    else:
        for mb in micro:
            if len(mb.rows) > 1:
                packed = logprobs.pack(*mb.take(ids, mask), mb.t, mb.width.completion)
                assert packed.positions_computed() <= split["max_tokens"]


def test_split_micro_batches_keep_each_rows_share():
    """split_micro_batches (ranks' forwards made equal in number) halves a micro-batch's SharedPrompts with its rows."""
    ids, mask, loss_mask, prompt_ids = batch()
    micro = micro_batches(mask, loss_mask, T, 16, 0, prompt_ids=prompt_ids)
    halves = logprobs.split_micro_batches(micro, 3)
    assert len(halves) == 3
    assert sum((mb.width.completion for mb in halves), ()) == micro[0].width.completion


def _another_branch(monkeypatch, family):
    """Each branch sees another: the written-out masks take each branch's prompt keys past the prompt's end (there,
    its sequence's first branch); the own forward's let every branch's tokens see the earlier branches'."""
    if family == "gpt_oss":
        form = logprobs.own_forward_tree_mask
        monkeypatch.setattr(logprobs, "own_forward_tree_mask", lambda model, packed: form(model, logprobs.Packed(
            **{**vars(packed), "segment": torch.where(packed.segment >= 0, -1, packed.segment)})))
        return
    attend = transformer.Tree.attend

    def wrong(self, window):
        mask = attend(self, window)
        mask.branches[..., :self.prompt.shape[1]] = True
        return mask
    monkeypatch.setattr(transformer.Tree, "attend", wrong)


def _no_window(monkeypatch, family):
    """The sliding windows left out of the tree's masks."""
    if family == "gpt_oss":
        monkeypatch.setattr(transformer, "tree_windows", lambda model: {None: None})
        return
    attend = transformer.Tree.attend
    monkeypatch.setattr(transformer.Tree, "attend", lambda self, window: attend(self, None))


@pytest.mark.parametrize("fault", [_another_branch, _no_window], ids=["another branch", "no window"])
@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_a_wrong_tree_mask_fails_the_comparison(family, fault, monkeypatch):
    """The tests' tolerance catches a wrong tree mask, on the written-out layers (Gemma 3) and the own forward
    (gpt-oss): a branch that sees another branch, or windows not applied, moves the log-probs by far more than 1e-5."""
    model, _ = architectures.tiny(family)
    padded = run(model, False, grad=False)[0]
    fault(monkeypatch, family)
    assert (run(model, True, grad=False)[0] - padded).abs().max() > 1e-2


def test_families_that_keep_the_padded_forward():
    """An attention implementation that may not take a 4-D mask as given keeps the padded forward; Qwen3.5 shares."""
    model, _ = architectures.tiny("qwen3_moe")
    assert logprobs.shares_prompts(model, False)
    model.config._attn_implementation = "flash_attention_2"
    assert not logprobs.shares_prompts(model, False)
    assert "attention implementation" in transformer.tree_refusal(model)
    model, _ = architectures.tiny("qwen3_5")
    assert logprobs.shares_prompts(model, transformer.decide(model).trains_written_out(model))


@pytest.mark.parametrize("flat", [False, True], ids=["a row per tree", "back to back"])
def test_the_fork_gives_each_row_alone(flat, monkeypatch):
    """`static_recurrent.fork` on one Gated DeltaNet module against the module's own forward over each row alone: the
    prompt's outputs and each branch's, for prompts shorter than the convolution's kernel (1 and 2 tokens: its
    tail is partly zeros) and longer, branches of 0 to 6 tokens."""
    token_by_token(monkeypatch)
    model, _ = architectures.tiny("qwen3_5")
    m = model.model.layers[0].linear_attn
    prompts, completion, t = (1, 2, 9), (7, 1, 4, 7, 0, 5), 6
    g = torch.Generator().manual_seed(0)
    ids, mask = [], []
    for n in prompts:
        prompt = torch.randint(3, 250, (n,), generator=g)
        for _ in range(2):
            ids.append(torch.cat([torch.zeros(max(prompts) - n, dtype=torch.long), prompt,
                                  torch.randint(3, 250, (t,), generator=g)]))
            mask.append((torch.arange(ids[-1].shape[0]) >= max(prompts) - n).long())
    ids, mask = torch.stack(ids), torch.stack(mask)
    packed = logprobs.pack(ids, mask, t, completion, flat=flat)
    table = torch.randn(256, m.hidden_size, generator=g)  # each token's hidden state, as an embedding gives it
    with torch.no_grad():
        out = static_recurrent.fork(m, table[ids.reshape(-1)][packed.source], packed.tree).flatten(0, 1)
        for r in range(ids.shape[0]):
            alone = m(table[ids[r][mask[r].bool()]][None])[0]  # (prompt + t, H)
            pl, branch = prompts[r // 2], (packed.segment.flatten() == r).nonzero()[:, 0]
            torch.testing.assert_close(out[branch], alone[pl:pl + len(branch)], rtol=1e-5, atol=1e-5)
            seq = packed.tree.group[r]
            torch.testing.assert_close(out[packed.tree.prompt[seq, :pl]], alone[:pl], rtol=1e-5, atol=1e-5)
            assert len(branch) == max(0, min(completion[r], t) - 1)


def _zero_initial_state(monkeypatch):
    """Each branch's delta rule from zero, not from its prompt's final state."""
    rule = static_recurrent._chunk_rule
    monkeypatch.setattr(static_recurrent, "_chunk_rule", lambda m: lambda *a, initial_state=None, **kw: rule(m)(
        *a, initial_state=None, **kw))


def _zero_conv_tail(monkeypatch):
    """Each branch's convolution from zeros, not from its prompt's last inputs."""
    tail = static_recurrent._conv_tail
    monkeypatch.setattr(static_recurrent, "_conv_tail", lambda x, length, width: tail(x, length, width) * 0)


@pytest.mark.parametrize("fault", [_zero_initial_state, _zero_conv_tail], ids=["zero state", "zero conv tail"])
def test_a_wrong_fork_fails_the_comparison(fault, monkeypatch, packs):
    """Qwen3.5's Gated DeltaNet layers in a tree: a branch that starts from zero states instead of its prompt's (the
    recurrent matrix, or the convolution's last inputs) moves the log-probs by far more than 1e-5."""
    model, _ = architectures.tiny("qwen3_5")
    padded = run(model, False, grad=False)[0]
    torch.testing.assert_close(run(model, True, grad=False)[0], padded, rtol=1e-5, atol=1e-5)
    fault(monkeypatch)
    assert (run(model, True, grad=False)[0] - padded).abs().max() > 1e-2
    assert packs


@pytest.mark.parametrize("prompts_routed", ["alike", "apart"])
def test_routing_replay_through_the_tree(prompts_routed, packs):
    """Routing replay: each packed token takes its recorded experts (moved with it), as in its own row. A group's
    rows whose prompts were routed alike share it; rows whose prompts were routed apart (a near tie the sampler broke
    differently in two rows) keep their own."""
    from layers import routing
    model, _ = architectures.tiny("qwen3_moe")
    ids, mask, loss_mask, prompt_ids = batch()
    g = torch.Generator().manual_seed(3)
    # each token's 2 experts of 8 in each of the 2 MoE layers, distinct
    route = torch.rand(*ids.shape, 2, 8, generator=g).argsort(-1)[..., :2]
    if prompts_routed == "alike":
        p = prompt_ids.shape[1]
        route[:, :p] = route[::G, :p].repeat_interleave(G, 0)
    replay = routing.of(model)
    out = []
    for shared in (False, True):
        (mb,) = micro_batches(mask, loss_mask, T, 16, prompt_ids=prompt_ids if shared else None)
        with torch.no_grad():
            forward = routing_replay.Forward(logprobs.Forward())  # --shared_prompts: as a tree around it
            logp = logprobs.completion_logprobs(model, *mb.take(ids, mask), mb.t, width=mb.width,
                                                forward=logprobs.TreeForward(forward) if shared else forward,
                                                extras={"routing": mb.take(route)[0]})[0]
        out.append(torch.zeros(loss_mask.shape).index_put((mb.rows,), logp * loss_mask[mb.rows, :mb.t]))
        assert replay.counts()[1] > 0
    replay.stop()
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)
    assert packs[0].ids.shape[0] == (len(PROMPTS) if prompts_routed == "alike" else len(COUNTED))


def test_a_training_step_with_shared_prompts(tmp_path):
    """train.py's first step, micro-batches of half a group and of a token budget, through update: the same loss,
    KL and gradient norm with and without --shared_prompts (later steps sample from weights that differ by rounding)."""
    import json
    import train
    rows, threads = {}, torch.get_num_threads()
    for flags in ([], ["--shared_prompts"], ["--shared_prompts", "--micro_batch_tokens=40"]):
        out = str(tmp_path / f"run{len(rows)}")
        train.main([f"--out_dir={out}", "--print_completions_every=0", "--max_steps=1", "--micro_batch_size=4",
                    "--save_every=0", "--max_completion_length=8", *flags])
        torch.set_num_threads(threads)  # as the other tests found it
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows[" ".join(flags)] = json.loads(f.readline())
    want = rows[""]
    assert want["grad_norm"] > 0 and want["kl"] == 0
    for got in rows.values():
        for k in ("loss", "kl", "grad_norm", "entropy", "reward"):
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k
