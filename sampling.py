"""The sampler: completions for left-padded prompts on the (sharded) policy, one or several turns each.

One concern in one file (past 650 lines on purpose): the decode loop and what drives it (the rows, compaction, the
draws; features/sampler_rows.py's rows add pausing, answers and admission to them) share one state; a step's
rollout, a `Stream` of rows across steps (features/stream_sampler.py) and held-out evaluation beside it are the
loop's only callers. What a rollout holds (`Rollout`) is in rollouts.py.

`sample` is one decode loop over a KV cache. In the core each step decodes one token per row, and a row ends at
EOS or at the length limit. A `Sampler` says what the loop runs on and with which rows: the core's, or the optional
features' (features/sampler_options.py: tensor parallelism, the Triton kernel, CUDA graphs off, kept decoders,
shared prompts, routing records, images, rows streaming through places, turns). With turns (features/sampler_rows.py)
a step may instead, where rows paused for an environment, append the environment's answer to those rows' cache
and resume them; a row ends at EOS or a stop sequence (unless the environment answers), or at the length limit.
The loop runs on either of two ways to run a step: `_StaticSteps`
(engine.StaticDecoder: the layers of the families it lists written
out, a preallocated cache, CUDA graphs) or `_HFSteps` (hf_decoder.HFDecoder:
the model's own forward with masks of our own, for every other model). `sample_rows` runs it on the gathered
weights of the policy for a step's rollout, `evaluate` on held-out prompts. `_Loop.run` stops at a check when
asked and goes on from it later: features/stream_sampler.py's `Stream` keeps rows decoding across training steps
(--max_staleness).
"""

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

import logprobs
import sharding
from rollouts import Rollout, Rows, reward_context, rollout_rows, score_batch
from layers import hf_decoder, routing, transformer, vision
from layers.engine import StaticDecoder

ENVIRONMENT = 2  # `kind` of a completion token an environment wrote (the policy's are the other real ones)

# The sampler's optional features (features/sampler_options.py, which puts itself here when imported: the run's
# feature list imports it). The core imports no feature file and a step's rollout calls none (a run that asks for
# them samples with their variants, chosen once: features/apply.py); `evaluate` and `check_exact` reach them
# through `_options()`.
OPTIONS = None


def _options():
    if OPTIONS is None:
        raise RuntimeError("this sampling call asks for an optional feature of the sampler: import "
                           "features.sampler_options first (train.py's feature list does)")
    return OPTIONS


# ----------------------------------------------------------------------------- tokens


_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """The "lowbias32" integer finaliser (Chris Wellons' hash prospector) on int64 tensors holding 32-bit
    values: int64 products wrap, and their low 32 bits are exact. In place on `x` (a tensor of the caller's
    making: no copy per operation, which over a batch's vocabulary is most of its cost), and returned."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(0x846CA68B).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def row_keys(seeds, step):
    """A 32-bit key per row, a pure function of (row seed, step): the row's random numbers for that token.

    A counter-based hash instead of a stateful generator: a row draws the same numbers whatever else is in its batch
    (padding, other rows, other ranks), and drawing them needs no host synchronisation.
    """
    return _mix32((seeds * 0x9E3779B1 + (step + 1) * 0x85EBCA77) & _MASK32)


def gumbel_noise(keys, vocab, start=0):
    """Standard Gumbel noise (n, V), float32, a pure function of each row's key and the vocabulary index
    (start, start + 1, ...: a tensor-parallel rank's slice of the vocabulary draws its tokens' own numbers).

    Uniforms of 23 bits, u = (k + 1/2) / 2^23, strictly inside (0, 1) in float32, so the noise
    -log(-log u) is always finite (between about -2.8 and 16.6).
    """
    index = torch.arange(start, start + vocab, device=keys.device)
    x = _mix32(keys[:, None] ^ (index * 0x27D4EB2F).bitwise_and_(_MASK32))
    u = (x >> 9).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 23))
    return u.log_().neg_().log_().neg_()


def filter_logits(logits, top_k=0, top_p=1.0):
    """Set logits outside the top-k and outside the top-p nucleus to -inf."""
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _gumbel_max(logits, keys, inv_temperature):
    """argmax(logits / T + Gumbel noise): a draw from softmax(logits / T) (the Gumbel-max trick), and its
    log-prob. Elementwise work and three reductions over the vocabulary, which torch.compile fuses into one
    pass over the (bf16) logits with the noise computed in registers: no float32 copy, no cumulative sum."""
    z = logits.float() * inv_temperature
    token = gumbel_noise(keys, z.shape[-1]).add_(z).argmax(-1)
    return token, z.gather(-1, token[:, None])[:, 0] - torch.logsumexp(z, -1)


@dataclasses.dataclass(frozen=True)
class Draw:
    """How the sampler draws a token from the logits: the sampling options as one value, with the draw over the
    whole vocabulary (`whole`) and over a tensor-parallel rank's slice of it (`sliced`) side by side. An option is a
    field here, its effect in both draws (or a filter, which the sliced draw gets by gathering the vocabulary), and
    a test; `sample` takes the fields as keywords too.

    A token is returned with its log-prob under the distribution that drew it: softmax(logits / T), renormalised
    over the top-k / top-p tokens when those are on (what vLLM calls processed log-probs), the behaviour policy that
    `importance_weights` corrects for. The training forward computes the unfiltered tempered log-prob, so with
    filters on the two differ by the filtered mass, also in `sampler_logprob_diff`. Sampling is Gumbel-max with the
    row's own noise (`keys` (n,) from row_keys): argmax over the filtered logits of logits / T + noise.
    """
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0            # keep the k largest logits (0: all)
    top_p: float = 1.0        # keep the smallest set of tokens holding this much probability (1: all)

    @classmethod
    def of(cls, cfg, temperature=None):
        """The run's draw (config.py's settings); temperature: another one (evaluation's greedy pass)."""
        return cls(cfg.temperature if temperature is None else temperature, cfg.top_k, cfg.top_p)

    def filtered(self):
        return bool(self.top_k) or self.top_p < 1.0

    def whole(self, logits, keys):
        """One token per row of logits (n, V), with its log-prob."""
        if self.temperature == 0 or self.filtered():
            return self._greedy_or_filtered(logits, keys)
        # compiled where the log-prob head is (CUDA with Triton): one fused pass over the logits
        pick = _compiled_gumbel_max() if logprobs.fused_head_available(logits.device) else _gumbel_max
        return pick(logits, keys, 1.0 / self.temperature)

    def _greedy_or_filtered(self, logits, keys):
        """`whole` at temperature 0 (greedy: the largest logit), or with filters on (the tempered logits, -inf
        outside the filters, take the same draw)."""
        if self.temperature == 0:
            logits = logits.float()
            token = logits.argmax(-1)
            return token, torch.log_softmax(logits, -1).gather(-1, token[:, None])[:, 0]
        pick = _compiled_gumbel_max() if logprobs.fused_head_available(logits.device) else _gumbel_max
        return pick(filter_logits(logits.float() / self.temperature, self.top_k, self.top_p), keys, 1.0)

    def sliced(self, logits, keys, tp, vocab):
        """`whole` where each rank of a tensor-parallel group `tp` holds a slice of a vocabulary of `vocab` tokens
        (logits (n, V_r), its ids tp.span(vocab)): each rank scores its slice (the greedy logit, or logit / T plus each
        token's own Gumbel noise) and the group keeps the first maximum (layers/tensor_parallel.py's
        `best_of_slices`), the draw of the whole vocabulary, ties to the lowest id as argmax breaks them. A filter
        needs every logit: the slices are gathered whole instead."""
        if self.filtered():
            return self.whole(tp.gather_vocab(logits, vocab), keys)
        start = tp.span(vocab, even=False)[0]
        z = logits.float() * (1.0 if self.temperature == 0 else 1.0 / self.temperature)
        score = z if self.temperature == 0 else gumbel_noise(keys, z.shape[-1], start).add_(z)
        return tp.best_of_slices(score, z, start)


_COMPILED = {}


def _compiled_gumbel_max():
    """`_gumbel_max` through torch.compile, built on first use; dynamic: any number of rows shares one kernel."""
    if "gumbel" not in _COMPILED:
        _COMPILED["gumbel"] = torch.compile(_gumbel_max, dynamic=True)
    return _COMPILED["gumbel"]


# ----------------------------------------------------------------------------- the decode loop


class Turn(NamedTuple):
    """A row that paused: what an environment's `respond` is shown."""
    row: int    # the row's index in the batch given to `sample`
    ids: list   # the row's completion so far: every token after the prompt, the environment's answers included
    start: int  # where in `ids` the policy's latest turn starts


@torch.no_grad()
def sample(model, prompt_ids, prompt_mask, *, max_new_tokens, eos_ids, pad_id, draw=None, seeds=None, all_done=None,
           check_every=8):
    """Sample a completion for each left-padded prompt: a prefill, then one decode loop over a KV cache.

    model: the model, or a `Sampler` of it, which says how its rows are decoded (the default: `Sampler(model)`). draw:
    how each token is drawn (`Draw`; by default at temperature 1 over the whole vocabulary). A row ends at its first
    EOS, or at the length limit of `max_new_tokens` tokens (truncated). Rows are looked at on the host every
    `check_every` tokens (and when one reaches the length limit); a row keeps sampling until then, and what it sampled
    past its end is dropped from the completion. `seeds` (N,) int64 fixes each row's random stream: the token at
    completion position j draws row_keys(seed, j), so rows with equal seeds and prompts sample equal completions,
    whatever their batch. `all_done(done) -> bool` decides at each check when to stop; under several processes it must
    agree across ranks (an all-reduce), so that every rank runs the same number of steps and none waits forever on a
    collective. The loop's steps and checks happen at the same iterations on every rank whatever its rows do."""
    sampler = model if isinstance(model, Sampler) else Sampler(model)
    all_done = all_done or (lambda done: bool(done.all()))
    n, device = prompt_ids.shape[0], prompt_ids.device
    seeds = (torch.arange(n, device=device) if seeds is None else seeds).to(device=device, dtype=torch.long)
    # every row's keys for every completion position at once (the last column for rows that finished): row_keys
    # is elementwise, so these are the numbers of drawing them one step at a time
    keys = row_keys(seeds[:, None], torch.arange(max_new_tokens + 1, device=device)[None, :])  # (N, T + 1)
    steps = sampler.steps(prompt_ids, prompt_mask.long(), max_new_tokens)
    try:
        loop = sampler.loop(steps, keys, max_new_tokens, eos_ids, pad_id, draw or Draw(), check_every)
        loop.run(lambda: all_done(torch.as_tensor(~loop.rows.active, device=device)))
        return loop.rows.rollout()
    finally:
        sampler.close()


class Sampler:
    """How `sample` decodes a model's rows: the steps they run on (the runner) and the loop with the rows that drive
    it (the scheduler). This one is the core's: every row in the batch from the prefill, on `_StaticSteps` where the
    run's decision (transformer.paths_of) says so and else on the model's own forward (`_HFSteps`), one turn each,
    finished rows compacted away, the decoder's memory given back after the call. A subclass overrides the methods
    whose answers it changes (features/sampler_options.py's `Options`)."""

    def __init__(self, model):
        self.model = model

    def steps(self, ids, attn, max_new):
        """The steps the rows (left-padded `ids`, mask `attn`) are decoded on."""
        model, positions = self.model, logprobs.position_ids_from_mask(attn)
        if transformer.paths_of(model).samples_written_out():
            return _StaticSteps(StaticDecoder.for_model(model, ids.shape[0], ids.shape[1] + max_new + 1), ids, attn,
                                positions)
        return _HFSteps(model, ids, attn, positions, max_new)

    def loop(self, steps, keys, max_new, eos_ids, pad_id, draw, check_every):
        """The loop over `steps` and its rows: the draw over the whole vocabulary, finished rows compacted away
        where the steps do that, and a rank-independent bound on its iterations: a row is active for at most max_new
        of them."""
        rows = _Rows(steps, max_new, eos_ids, pad_id, keys)
        return _Loop(steps, rows, draw.whole, check_every, steps.compacts, max_new)

    def close(self):
        """Give the decoder's memory back before training needs it."""
        self.model.__dict__.pop("_static_decoder", None)


class _StaticSteps:
    """Steps on StaticDecoder: completion position j of a row lives in cache slot P + j (P the padded prompt
    length), so every row's rotary table, set at prefill, stays right however long its turns; finished rows
    can be compacted out of the batch."""

    feeds_rows = True  # a block can be fed to some batch rows alone (extend's batch_rows)
    prompts_alone = False  # the same for every long block, a new row's prompt or an answer
    replay = None  # routing is recorded inside the decoder (StaticDecoder.record), not by the routers
    compacts = True
    share = False  # rows of one prompt run it once (features/sampler_options.py's variant)

    def __init__(self, dec, ids, attn, positions):
        """dec: the StaticDecoder, of at least the rows `ids` and P + max_new + 1 slots (slot P + max_new: where
        finished rows write what they still decode; never attended)."""
        self.dec, self.p = dec, ids.shape[1]
        # (N, V); with no rows, every place is empty until rows are admitted
        self.first_logits = self.dec.prefill(ids, attn, positions) if len(ids) else None

    def decode(self, tok, cols, cols_h):
        """cols: every row's position (an int), or a tensor of each row's, the largest of them max(cols_h)."""
        return self.dec.decode(tok, cols + self.p, self.p + int(cols_h.max()))

    def extend(self, ids, valid, start, top, batch_rows=None):
        return self.dec.extend(ids, valid, start + self.p, self.p + top, batch_rows)

    def copy_rows(self, src, dst, first, last):
        """Batch rows dst take the cache of rows src from completion position `first` to `last` (included)."""
        self.dec.copy_rows(src, dst, self.p + first, self.p + last + 1)

    def truncate(self, batch_rows, ends):
        self.dec.truncate(batch_rows, ends + self.p)

    def routed(self, prompt_width, length, rows):
        return self.dec.routed(prompt_width, length, rows)

    def admit(self, batch_rows, positions):
        """Batch rows `batch_rows` (a tensor) made empty places for rows whose prompts have these positions (k, P)."""
        self.dec.admit(batch_rows, positions)

    def compact(self, keep, live, fed_top):
        """Keep the batch rows `keep` (a tensor) if that is worth a copy of the cache; True if it was done."""
        if not self.dec.worth_compacting(keep.numel(), live):
            return False
        self.dec.compact(keep, self.p + fed_top + 1)
        return True


class _HFSteps:
    """Steps on the model's own forward (hf_decoder.HFDecoder). The cache grows by a column per fed token for all
    rows; the masks say which columns are a row's own tokens, so an answer appended to some rows, or samples
    forgotten, leave holes that are never attended. A place takes a new row by forgetting its own (every column a
    hole, its recurrent states zero); columns that are holes in every row are dropped. compact: as StaticDecoder's,
    with each row's cache taken along."""

    share = False
    feeds_rows = False  # an answer is fed with the batch, as one padded block
    prompts_alone = True  # but a new row's prompt runs on its row alone, as a prefill (`extend`)
    compacts = False  # but where rows stream through places

    def __init__(self, model, ids, attn, positions, max_new, replay=None, images=None):
        if replay is None and routing.attached(model) is not None:  # routers left replaying a training forward's
            routing.attached(model).stop()  # choice: the model's own forward routes live here
        self.model, self.first_pos = model, positions[:, -1] + 1  # (N,) position of completion position 0
        self.spare = max_new  # the completion position where finished rows write on: a hole, never a token
        self.replay = replay  # the routers' recorder (routing.Replay) while routing is recorded, else None
        self.dec = hf_decoder.HFDecoder(model, ids, attn, positions, replay, images)
        self.first_logits = self.dec.first_logits
        self.images = {}  # batch row -> (pixel values, grid) of the images of the prompt it was admitted for

    def decode(self, tok, cols, cols_h):
        """One token per row at completion position cols (an int for every row, or a tensor of each row's)."""
        real = None if isinstance(cols, int) and cols < self.spare else \
            torch.as_tensor(cols, device=tok.device).expand(tok.shape) < self.spare
        return self.dec.decode(tok, self.first_pos + cols, real)

    def extend(self, ids, valid, start, top, batch_rows=None):
        """The blocks, each after its row's tokens: the logits after each. With batch_rows, the blocks are the
        prompts (but their last tokens) of rows just admitted there (features/sampler_rows.py's `Rows._feed_heads`),
        run as a prefill of those rows with their images, and give no logits (each prompt's last token is fed next,
        with the batch)."""
        if batch_rows is not None:
            if not bool((start < 0).all()):
                raise ValueError("on the model's own forward only a new row's prompt is fed to its row alone")
            return self._prompts(ids, valid, batch_rows)
        cols = start[:, None] + torch.arange(ids.shape[1], device=ids.device)  # (N, K) completion positions
        return self.dec.extend(ids, valid, self.first_pos[:, None] + cols)

    def _prompts(self, ids, valid, batch_rows):
        """Prompts (k, L), right-padded, of rows just admitted into batch_rows: left-padded, and prefilled there."""
        width = ids.shape[1]
        attn = torch.arange(width, device=ids.device) >= width - valid.sum(1, keepdim=True)
        left = torch.zeros_like(ids)
        left[attn] = ids[valid]
        images = None
        if self.images:
            held = [self.images.pop(int(b), (torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)))
                    for b in batch_rows.tolist()]
            pictures = vision.PromptImages([p for p, _ in held], [g for _, g in held]).to(ids.device)
            images = _image_prefill(self.model, left, attn.long(), pictures)
        self.dec.prefill_rows(batch_rows, left, attn, logprobs.position_ids_from_mask(attn.long()), images)

    def truncate(self, batch_rows, ends):
        self.dec.truncate(batch_rows, ends, self.first_pos)

    def routed(self, prompt_width, length, rows):
        return self.dec.routed(prompt_width, self.first_pos, length, rows)

    def admit(self, batch_rows, positions, images=None):
        """Batch rows `batch_rows` (a tensor; past the batch, new rows) made empty places for rows whose prompts
        have these positions (k, P) and images (vision.PromptImages, or None)."""
        grow = int(batch_rows.max()) + 1 - len(self.first_pos)
        if grow > 0:
            self.dec.grow(grow)
            self.first_pos = torch.cat([self.first_pos, self.first_pos.new_zeros(grow)])
        self.first_pos[batch_rows] = positions[:, -1] + 1
        self.dec.admit(batch_rows)
        for b, (pv, grid) in zip(batch_rows.tolist(), zip(*(images.pixel_values, images.grid)) if images else ()):
            if grid.shape[0]:
                self.images[b] = pv, grid

    def compact(self, keep, live, fed_top):
        if keep.numel() > 0.75 * live:  # each forward's cost follows its rows: drop them once a quarter has ended
            self.dec.pack()  # but drop now the columns no row holds (past the ends of rows that stay)
            return False
        self.dec.keep_rows(keep)
        self.first_pos = self.first_pos[keep]
        self.images = {}  # every row kept has been prefilled
        return True


def _image_prefill(model, ids, attn, images):
    """What HFDecoder's prefill needs of prompts with images: the language model run with their embeddings, the
    prompt's rotary positions and each row's delta (layers/vision.py); None when no row has an image."""
    if not any(g.shape[0] for g in images.grid):
        return None
    real = attn.bool()
    mask = vision.image_mask(model, ids, ids.shape[1], real)
    rope, delta = vision.rope_positions(model, ids, mask, images, real)
    feats = vision.features(model, images)  # once per distinct prompt, whatever the group size

    def run(ids_, **kwargs):
        return vision.hidden_states(model, ids_, mask, images, feats=feats, **kwargs)
    return run, rope, delta


def _first_stop(seq, lo, begin, end, turn_start, eos, stops):
    """The first completion position in [begin, end) that ends a turn: an EOS token, or the last token of a
    stop sequence that lies within the turn. seq holds positions lo, lo + 1, ... ; None if there is none."""
    for c in range(begin, end):
        if seq[c - lo] in eos:
            return c
        for s in stops:
            if c - len(s) + 1 >= turn_start and tuple(seq[c - len(s) + 1 - lo:c + 1 - lo]) == s:
                return c
    return None


class _Loop:
    """The loop behind `sample` and features/stream_sampler.py's `Stream`. Each iteration draws a token for every row of
    the batch; at a check the rows find their ends (`_Rows.check`) and then the batch they run in next
    (`_Rows.schedule`: finished rows compacted away); then it feeds the batch (`_Rows.feed`: one decode step, or with
    features/sampler_rows.py's rows the blocks they hold to feed, an environment's answer or a new row's prompt, in an
    extend step). `_Rows` holds the rows' state.

    `run(until)` decodes until `until()` holds at a scheduled check, or for `limit` iterations (then the batch's active
    rows end, truncated). A run that stopped on `until` can be run again: it goes on from that check with the logits it
    had (the next token of each row is drawn from them, by the weights that computed them), and feeds the token drawn at
    the check on the steps' weights of then."""

    def __init__(self, steps, rows, draw, check_every, compact, limit):
        self.steps, self.rows, self.draw, self.check_every, self.compact = steps, rows, draw, check_every, compact
        self.limit = limit  # a run's iterations at most, the same on every rank whatever its rows do
        self.logits, self.held = steps.first_logits, None  # held: (tok, col) of the check a run stopped at

    def run(self, until):
        """True if the run ended at the limit, False if `until` stopped it (`resume` goes on from there)."""
        rows, it = self.rows, 0
        while True:
            tok, col = rows.draw(self.logits, self.draw)
            it += 1
            final, scheduled = it >= self.limit, it % self.check_every == 0
            if scheduled or final or (rows.ptr[rows.live] >= rows.max_new).any():
                rows.check(tok, final)
                if final or (scheduled and until()):
                    self.held = tok, col
                    return final
                tok, col = rows.schedule(tok, col, self.compact)
            self.logits = rows.feed(self.logits, tok, col)

    def resume(self):
        """Before another `run`: go on from the check the last run stopped at, the token drawn there fed."""
        if self.held is None:
            return
        tok, col = self.held
        self.held = None
        self.logits = self.rows.feed(self.logits, *self.rows.schedule(tok, col, self.compact))


class _Rows:
    """The rows of one `_Loop`: single-turn rows that end at EOS or at the length limit, all in the batch from the
    prefill (features/sampler_rows.py's `Rows` adds turns, stop sequences, admission and routing records).

    State per row, on the host (which knows every change without reading the device): `ptr`, the row's
    completion length so far (where its next token goes), and `active`, False once the row has ended. The
    batch (`rows_h`, global row indices, and `rows` on the device) is what the steps run on; per batch row,
    `feed_h` is the completion position fed this iteration. A finished row still in the batch writes past its end
    (up to the spare last column) in step with the others, so that while the live rows share a position (`uni`;
    always, for single-turn sampling) the iteration is plain columns, with no per-row state on the device.
    """

    def __init__(self, steps, max_new, eos_ids, pad_id, keys):
        n, device = keys.shape[0], keys.device
        self.steps, self.n, self.max_new, self.pad_id, self.device = steps, n, max_new, pad_id, device
        self.keys = keys  # (n, max_new + 1) each row's random keys by completion position (row_keys)
        self.spare = max_new  # the last column and cache position, where finished rows may write
        self.tokens = torch.full((n, max_new + 1), pad_id, dtype=torch.long, device=device)
        self.logps = torch.zeros(n, max_new + 1, dtype=torch.float32, device=device)
        self.ptr, self.active = np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool)
        self.truncated, self.checked = np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64)
        self.held = np.zeros(n, dtype=np.int64)  # the iterations each row held a place in the batch
        self.rows_h, self.rows = np.arange(n), torch.arange(n, device=device)  # the batch: every row, from the prefill
        self.feed_h = np.full(n, -1, dtype=np.int64)
        self.eos = set(int(e) for e in eos_ids)
        self.triggers = torch.tensor(sorted(self.eos), dtype=torch.long, device=device)
        self.uni = 0  # the position every batch row writes next, while they share it (single-turn sampling), else None
        self.live = self.rows_h.copy()  # the batch's active rows (global indices); they change only at checks

    def draw(self, logits, draw):
        """A token for every batch row at its position: (tokens, their column: an int shared by all)."""
        rows_h, rows, col = self.rows_h, self.rows, self.uni
        self.held[rows_h] += 1
        if len(rows_h) == 0:  # a rank whose rows all finished keeps iterating (checks are collective), idle
            return logits.new_zeros(0, dtype=torch.long), None
        where = (slice(None), col) if len(rows_h) == self.n else (rows, col)  # plain columns, host bookkeeping only
        tok, lp = draw(logits, self.keys[where])
        self.tokens[where], self.logps[where] = tok, lp
        self.ptr[self.live] += 1
        self.feed_h[:] = col
        self.uni = min(col + 1, self.spare)
        return tok, col

    def finish(self, global_rows, cut):
        self.active[global_rows] = False
        self.truncated[global_rows] = cut

    def check(self, tok, final=False):
        """Ends (and, with turns, pauses and answers) and the length limit for the batch's active rows, and at the
        loop's `final` iteration the end of every one, truncated."""
        self._answer(self._stops(), tok)
        rows_h = self.rows_h
        over = rows_h[self.active[rows_h] & (final | (self.ptr[rows_h] >= self.max_new))]
        if len(over):  # the length limit (or the loop's), with no stop in its last tokens
            self.finish(over, True)

    def _stops(self):
        """{global row: the position its turn ended at} over the positions since each row's last check: its first
        EOS there, found on the device."""
        live = self.rows_h[self.active[self.rows_h]]
        if not len(live):
            return {}
        lo, hi = int(self.checked[live].min()), int(self.ptr[live].max())
        hit = self._hits(live, lo, hi, self.checked[live])
        has, first = torch.stack([hit.any(1).long(), hit.long().argmax(1)]).tolist()
        self.checked[live] = self.ptr[live]
        return {r: lo + f for r, h, f in zip(live.tolist(), has, first) if h}

    def _hits(self, live, lo, hi, since):
        """(rows `live`, positions lo .. hi - 1): where a trigger token lies at or past `since` (each row's) and
        before the row's length."""
        window = self.tokens[torch.as_tensor(live, device=self.device), lo:hi]
        position = torch.arange(lo, hi, device=self.device)
        fresh = (position >= torch.as_tensor(since, device=self.device)[:, None]) & \
            (position < torch.as_tensor(self.ptr[live], device=self.device)[:, None])
        return torch.isin(window, self.triggers) & fresh

    def _answer(self, found, tok):
        """End the rows `found` ends, if any: what a row sampled past its end is padding in the rollout."""
        ended = np.array(sorted(found), dtype=np.int64)
        ends = np.array([found[r] + 1 for r in ended])
        self.ptr[ended], self.checked[ended] = ends, ends
        self.finish(ended, False)

    def schedule(self, tok, col, compact):
        """After a check, the batch the rows run in next: where `compact`, the finished rows dropped; (tok, col) of
        the batch as it is then. (features/sampler_rows.py's rows give ended rows' places to rows waiting.)"""
        if compact and len(self.rows_h):
            tok, col = self.compact(tok, col)
        self.realign()
        return tok, col

    def compact(self, tok, col):
        """Drop the finished rows from the batch where the steps find it worth a copy of the cache; the tokens and
        columns of the rows kept."""
        keep = np.flatnonzero(self.active[self.rows_h])
        keep_t = torch.as_tensor(keep, device=self.device)
        if not self.steps.compact(keep_t, len(self.rows_h), int(self.feed_h[keep].max()) if len(keep) else 0):
            return tok, col
        self.rows_h, self.rows, self.feed_h = self.rows_h[keep], self.rows[keep_t], self.feed_h[keep]
        return tok[keep_t], col if isinstance(col, int) else col[keep_t]

    def realign(self):
        """After a check: the batch's live rows, and whether every batch row writes the same position next."""
        rows_h = self.rows_h
        self.live = rows_h[self.active[rows_h]]
        following = np.where(self.active[rows_h], self.ptr[rows_h], np.minimum(self.feed_h + 1, self.spare))
        self.uni = int(following[0]) if len(following) and following.min() == following.max() else None

    def feed(self, logits, tok, col):
        """The batch's next logits: its tokens fed (a decode step); none where the batch holds no row."""
        return self.steps.decode(tok, col, self.feed_h) if len(self.rows_h) else logits[:0]

    def rollout(self):
        """The Rollout of every row: its tokens up to its length, each one the policy's."""
        device, t = self.device, int(self.ptr.max(initial=1))
        real = torch.arange(t, device=device) < torch.as_tensor(self.ptr, device=device)[:, None]  # (N, T)
        return Rollout(completion_ids=self.tokens[:, :t].masked_fill(~real, self.pad_id),
                       completion_mask=real.long(), policy_mask=real.long(),
                       truncated=torch.tensor(self.truncated, device=device),
                       logprobs=self.logps[:, :t].masked_fill(~real, 0.0),
                       turns=torch.ones(self.n, dtype=torch.long, device=device),
                       held_steps=torch.tensor(self.held, device=device))


# ----------------------------------------------------------------------------- rollouts and evaluation


def encode_prompts(tokenizer, prompts, cfg, device):
    """Left-padded prompt ids and mask; prompts longer than max_prompt_length keep their end."""
    return tokenizer(prompts, return_tensors="pt", padding=True, truncation=True, max_length=cfg.max_prompt_length,
                     add_special_tokens=False).to(device)


def rows_of(prompt_rows, G, d, tokenizer, cfg, seed_of):
    """This rank's rollouts.Rows of `prompt_rows` (dataset rows, every rank's), G of each (`spread`). All rows are
    tokenized together, so every rank pads alike."""
    every, mine, fields, seeds = spread(prompt_rows, G, d, seed_of)
    prompts = [r["prompt"] for r in every]
    enc = encode_prompts(tokenizer, prompts, cfg, d.device)
    return Rows(prompts[mine], fields, mine, enc.input_ids[mine], enc.attention_mask[mine], seeds, None, None)


def spread(prompt_rows, G, d, seed_of):
    """Every rank's rows of `prompt_rows`, G of each in order (row i is prompt i // G), this rank's slice of them, its
    rows' fields (but the prompt) and seeds. Where the rows do not split evenly over the processes, the last rank's
    share is padded with copies of the last row, seed included (they sample alike; the caller drops them), so every
    rank samples as many rows and makes the same collectives. Seeds are seed_of(global row indices): any world size
    samples the same completions."""
    count = len(prompt_rows) * G
    per_rank = -(-count // d.world_size)
    index = list(range(count)) + [count - 1] * (per_rank * d.world_size - count)
    mine = slice(d.rank * per_rank, (d.rank + 1) * per_rank)
    every = [prompt_rows[i // G] for i in index]
    fields = {k: [r[k] for r in every][mine] for k in prompt_rows[0] if k != "prompt"}
    return every, mine, fields, seed_of(torch.tensor(index[mine], dtype=torch.long, device=d.device))


def sample_rows(policy, tokenizer, rows, draw, cfg, d, eos_ids):
    """The rollouts.Batch of `rows` (rollouts.Rows): one completion per row on the gathered weights, in eval mode,
    each token drawn as `draw` (a Draw) says, every row at once on each rank alone."""
    was_training = policy.training
    policy.eval()
    with sharding.gathered(policy):  # full weights once for the whole decode loop
        rollout = policy(sample, rows.prompt_ids, rows.prompt_mask, max_new_tokens=cfg.max_completion_length,
                         eos_ids=eos_ids, pad_id=tokenizer.pad_token_id, draw=draw, seeds=rows.seeds,
                         all_done=sharding.all_done_fn(d))
    policy.train(was_training)
    return rows.sampled(rollout, _text(policy, tokenizer, rollout))


def _text(policy, tokenizer, rollout):
    """The completions' text, once the decoder's copies are freed: the memory given back before training allocates
    its own tensors, where they are large."""
    sharding.return_host_memory(sum(p.numel() * p.element_size() for p in policy.parameters()))
    # the whole trajectory, tool calls and results included; padding after the end, special tokens dropped
    return tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)


def decodes_written_out(model):
    """Whether the run's decision (transformer.paths_of) lets `model` sample on the written-out decoder (a
    vision-language model's never does)."""
    return not vision.is_vision_model(model) and transformer.paths_of(model).samples_written_out()


def group_share(rollout, tp, n, pad=0):
    """This rank's n rows of a tensor-parallel group's rollout (rank r's at r * n), as wide as its longest completion,
    as they would be alone; its prompt routing without the `pad` columns the group's wider prompts added."""
    mine = rollout_rows(rollout, torch.arange(tp.rank * n, (tp.rank + 1) * n))
    if mine.prompt_routing is not None:  # this rank's own prompt width
        mine.prompt_routing = mine.prompt_routing[:, pad:]
    width = int(mine.completion_mask.sum(1).max()) if n else 0
    trim = {f.name: getattr(mine, f.name) for f in dataclasses.fields(Rollout)}
    for k, v in trim.items():
        if v is not None and v.dim() >= 2 and k != "prompt_routing":
            trim[k] = v[:, :width]
    return Rollout(**trim)


def evaluate(policy, tokenizer, task, weights, cfg, d, eos_ids, agent=None, step=None, images=None):
    """Held-out prompts: greedy accuracy and reward (one completion each), then the mean over G samples each. The
    rows are made, sampled and scored as a step's are (the run's `rows_of` and `sample_rows`, as
    features/sampler_options.py's `chosen` picks them for its settings, its `agent` and `images`;
    rollouts.score_batch), with seeds of their own, and the scores gathered from every rank (the padding rows of
    `spread` dropped)."""
    make_rows, sample_batch = _options().chosen(cfg, d, agent, images)
    rows = task.eval_rows
    if not rows:
        return {}
    results = {}
    for label, G, draw in (("greedy", 1, Draw.of(cfg, 0.0)), ("sampled", cfg.num_generations, Draw.of(cfg))):
        totals, correct = [], []
        comp = {}
        for start in range(0, len(rows), cfg.prompts_per_step):
            chunk = rows[start:start + cfg.prompts_per_step]
            count = len(chunk) * G
            # the same seeds at every evaluation: successive evaluations differ by the policy, not by luck
            base = start * G + (cfg.seed + 7) * 1_000_003
            batch = sample_batch(policy, tokenizer, make_rows(chunk, G, d, tokenizer, cfg, lambda i: i + base), draw,
                                 cfg, d, eos_ids)
            total, parts = score_batch(batch, task.reward_funcs, weights, tokenizer, reward_context(cfg, step))
            totals.append(sharding.all_gather_rows(total, d)[:count])
            for k, v in parts.items():
                comp.setdefault(k, []).append(sharding.all_gather_rows(v, d)[:count])
            if task.accuracy_reward is not None:
                correct.append(comp[task.accuracy_reward][-1] >= 1.0)
        total = torch.cat(totals)
        suffix = "" if label == "sampled" else "_greedy"
        results[f"eval/reward{suffix}"] = total.nanmean().item()
        if correct:
            results[f"eval/accuracy{suffix}"] = torch.cat(correct).float().mean().item()
        if label == "sampled":
            results.update({f"eval/reward/{k}": torch.cat(v).nanmean().item() for k, v in comp.items()})
    return results


# ----------------------------------------------------------------------------- the start-up check


def _plain_logprobs(model, prompt_ids, prompt_mask, rollout):
    """The log-prob of each policy token, from one forward of the model over each row's real tokens alone."""
    out = torch.zeros_like(rollout.logprobs)
    for i in range(prompt_ids.shape[0]):
        p = prompt_ids[i][prompt_mask[i].bool()]
        c = rollout.completion_ids[i][rollout.completion_mask[i].bool()]
        logits = model(input_ids=torch.cat([p, c])[None]).logits[0, len(p) - 1:-1].float()
        out[i, :len(c)] = torch.log_softmax(logits, -1).gather(-1, c[:, None])[:, 0]
    return out


@torch.no_grad()
def check_exact(model, tolerance=2e-3, new_tokens=3, tp=None):
    """Why `model`'s log-probs cannot be trusted on the paths it takes here, in one line; None when they can.

    First what the general path cannot express (hf_decoder.unsupported); then a few tokens compared: two
    left-padded rows of random tokens sample a rollout that pauses after every token, forgets a token sampled
    past the pause, takes answers of different lengths into its cache and resumes; the sampler's log-probs
    and the training forward's must equal one plain forward of the model over each row's trajectory alone.
    This catches an architecture whose layers, masks, states or head our paths get wrong, listed or not.
    Meaningful for float32 weights (the default); lower precision differs by its rounding, and is not checked.
    A vision-language model is checked on text prompts: its language model on the general path, as with images;
    what images add (their embeddings in place of the image tokens, the multi-axis rotary positions of the
    grid, decode positions continued past it) is compared with the model's own forward by tests/test_vision.py,
    as a start-up check would need the model's image processor and pictures. tp: the sampler's tensor-parallel
    group (every rank of it calls this alike), whose sliced decoder is then what is checked.
    """
    name = type(model).__name__
    if not transformer.paths_of(model, 1 if tp is None else tp.size).samples_written_out():
        why = hf_decoder.unsupported(model)
        if why:
            return f"{name}: the sampler cannot reproduce {why}"
    weight = model.get_output_embeddings().weight
    if weight.dtype != torch.float32:
        return None
    device, vocab = weight.device, weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 5), generator=g).to(device)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], device=device)
    answers = iter([[3, 1, 4], [1], [5, 9], [2, 6, 5]])
    was_training = model.training
    model.eval()
    try:
        # every token is a stop: each turn is one token, and the check every 2 tokens forgets the one after it
        rollout = _options().sample(model, ids, mask, max_new_tokens=new_tokens * 5, eos_ids=range(vocab),
                                         pad_id=0, seeds=torch.tensor([1, 2]), check_every=2, max_turns=new_tokens,
                                         respond=lambda turns: [[t % vocab for t in next(answers, [7])] for _ in turns],
                                         tp=tp)
        want = _plain_logprobs(model, ids, mask, rollout)
        full_ids = torch.cat([ids, rollout.completion_ids], 1)
        full_mask = torch.cat([mask, rollout.completion_mask], 1)
        train, _ = logprobs.completion_logprobs(model, full_ids, full_mask, rollout.completion_ids.shape[1])
    finally:
        model.train(was_training)
    policy = rollout.policy_mask.bool()
    for what, got in (("sampler", rollout.logprobs), ("training forward", train)):
        diff = (got - want)[policy].abs().max().item()
        if not diff <= tolerance:  # NaN fails too
            return (f"{name}: the {what}'s log-probs differ from the model's own forward by {diff:.3g} "
                    f"(a layer, mask, recurrent state or logit transform it does not reproduce)")
    return None
