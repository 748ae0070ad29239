"""Rows that decode across training steps: `Stream`, the sampler of a run with --max_staleness (features/streaming.py's
RolloutStream runs it). It runs sampling.py's loop (`_Loop`, which stops at a check when asked and goes on from it
later) on features/sampler_rows.py's rows, which wait for a decode place and are admitted as others end.
"""

import functools

import numpy as np
import torch
import torch.nn.functional as F

import logprobs
from layers import routing, vision
from sampling import _HFSteps, _Loop, _StaticSteps, decodes_written_out, row_keys
from features.sampler_options import iterations, static_steps
from features.sampler_rows import Rows, Waiting


class Stream:
    """Rows that decode across training steps: the sampler of a run with --max_staleness. Rows are added (`add`, a
    step's prompts, each row with its seed and a tag naming it) to a queue that `places` decode places take in
    order; `run` decodes until the rows asked for have all ended and stops at that check, the other rows in the
    middle of theirs; `take` hands rows out and frees them. Between runs the trainer changes the weights: the next
    run copies them into the decoder (`StaticDecoder.load`, in place; the model's own forward reads them live) and
    the rows in flight go on with the cache they have. Each token is drawn from the logits of the weights of the
    run that drew it, and its version (`run`'s) is recorded with it (Rollout.versions); so is the version that ran
    the row's prompt into the cache (Rollout.context_version). A token drawn after a change still attends to the
    K/V older weights computed, so its behaviour policy is neither version's: the loss takes the sampler's
    log-prob as the behaviour policy's for every token of a row whose context is older than the training weights.

    On the written-out decoder a row's cache slots start at `prompt_width` (every prompt is left-padded to it): the
    widest prompt the run can have (max_prompt_length). Rows sample what `sample` samples for them; respond,
    max_turns, stop_sequences, on_end, share_prompts and record_routing are `sample`'s, with the rows' tags where
    `sample` gives row numbers (a Turn's `row` is its row's tag); a taken row's prompt_routing is `prompt_width`
    wide. static_cache=False: on the model's own forward, as `sample`'s (a model the written-out decoder does not
    sample takes it anyway, and so do prompts with images). tp: as `sample`'s, a tensor-parallel group's share:
    every rank of the group adds, runs and takes the same rows."""

    def __init__(self, places, capacity, prompt_width, max_new_tokens, eos_ids, pad_id, draw, device, check_every=8,
                 on_end=None, cuda_graph=True, attention_kernel=False, dtype=None, tp=None, respond=None,
                 max_turns=1, stop_sequences=(), share_prompts=False, static_cache=True, record_routing=False):
        self.places, self.capacity, self.width, self.max_new = places, capacity, prompt_width, max_new_tokens
        self.static_cache = static_cache  # False: the model's own forward, as `sample`'s
        self.max_turns, self.share = max_turns, share_prompts
        # a stop is looked for every check_every tokens, and at most every completion's length: rows a run waits
        # for are then found ended as soon as they can all have
        self.draw, self.check_every, self.device, self.dtype = draw, min(check_every, max_new_tokens), device, dtype
        self.tp = tp if tp is not None and tp.size > 1 else None  # a tensor-parallel group's share: its ranks all
        # hold the same rows and decode them together on slices of the layers (as `sample`'s tp)
        self.first_slot = prompt_width  # no row's prompt starts before this cache slot (the decoder reads from it)
        self.cuda_graph, self.attention_kernel = cuda_graph, attention_kernel
        prompts = torch.full((capacity, prompt_width), pad_id, dtype=torch.long, device=device)
        self.waiting = Waiting(prompts, torch.zeros_like(prompts), torch.zeros_like(prompts), places)
        self.waiting.rows = []
        keys = torch.zeros(capacity, max_new_tokens + 1, dtype=torch.long, device=device)
        self.tag_of = [None] * capacity  # each row index's tag
        by_tag = respond and (lambda turns: respond([t._replace(row=self.tag_of[t.row]) for t in turns]))
        rows = self.rows = Rows(None, capacity, max_new_tokens, eos_ids, pad_id, device, self.waiting, keys,
                                stop_sequences, by_tag, max_turns,
                                on_end and (lambda r, ids: on_end([self.tag_of[i] for i in r], ids)), first=0)
        rows.active[:] = False  # no row yet: `add` starts each
        rows.route_width = prompt_width if record_routing else None
        self.free = np.ones(capacity, dtype=bool)  # row indices no row holds
        self.slot = {}  # tag -> row index
        self.version = 0  # the weights' version the last run decoded with
        self.versions = [[] for _ in range(capacity)]  # per row, (position, version): from there on, drawn by it
        self.loop = None

    def in_flight(self):
        """The tags of the rows added and not taken."""
        return list(self.slot)

    def add(self, prompt_ids, prompt_mask, seeds, tags, images=None):
        """Queue rows: left-padded prompts (k, S), S <= prompt_width, their seeds (k,), tags (k hashables) and
        images (vision.PromptImages of the k rows, on the model's own forward; or None)."""
        k, s = prompt_ids.shape
        if s > self.width:
            raise ValueError(f"prompts of {s} tokens in a stream of {self.width}-token prompts")
        rows = self.rows
        slots = np.flatnonzero(self.free & ~np.isin(np.arange(self.capacity), rows.rows_h))[:k]
        if len(slots) < k:
            raise RuntimeError(f"the stream holds {self.capacity} rows; {k} more do not fit")
        if images is not None or self.waiting.images is not None:
            self._add_images(slots, images)
        at = torch.as_tensor(slots, device=self.device)
        attn = F.pad(prompt_mask.long(), (self.width - s, 0))
        self.waiting.ids[at] = F.pad(prompt_ids, (self.width - s, 0), value=rows.pad_id)
        self.waiting.attn[at], self.waiting.positions[at] = attn, logprobs.position_ids_from_mask(attn)
        rows.keys[at] = row_keys(seeds.to(self.device, torch.long)[:, None],
                                 torch.arange(self.max_new + 1, device=self.device)[None, :])
        rows.tokens[at], rows.logps[at], rows.kind[at] = rows.pad_id, 0.0, 0
        for a in (rows.ptr, rows.turn_start, rows.checked, rows.held):
            a[slots] = 0
        for records in rows.routes or ():  # what the row index's last row recorded
            records[at] = -1
        rows.kept[slots] = False
        rows.active[slots], rows.truncated[slots], rows.turns[slots] = True, False, 1
        self.free[slots] = False
        for r, tag in zip(slots, tags):
            self.slot[tag], self.tag_of[r] = int(r), tag
            self.versions[r] = [(0, self.version)]
        self.waiting.rows += [int(r) for r in slots]
        self.first_slot = min(self.first_slot, self.width - int(prompt_mask.sum(1).max()))

    def _add_images(self, slots, images):
        """The rows `slots` take `images` (None: none), which their places' prefills take in."""
        if images is not None and (self.tp is not None or isinstance(getattr(self.loop, "steps", None), _StaticSteps)):
            raise ValueError("prompts with images stream on the model's own forward alone")
        if self.waiting.images is None:
            self.waiting.images = vision.PromptImages([torch.zeros(0, 0)] * self.capacity,
                                                      [torch.zeros(0, 3, dtype=torch.long)] * self.capacity)
        for j, r in enumerate(slots):
            w = self.waiting.images
            w.pixel_values[r] = images.pixel_values[j] if images is not None else torch.zeros(0, 0)
            w.grid[r] = images.grid[j] if images is not None else torch.zeros(0, 3, dtype=torch.long)

    @torch.no_grad()
    def run(self, model, tags, version=0, all_done=None):
        """Decode on `model`'s weights (`version`: how many training steps made them) until the rows `tags` have all
        ended, on every rank with `all_done` (sharding.all_done_fn: every rank runs the same iterations)."""
        rows = self.rows
        if version != self.version:  # what is drawn from here on is this version's
            waiting = set(self.waiting.rows)  # rows not admitted yet: nothing of theirs is in the cache
            for r in np.flatnonzero(~self.free & rows.active):
                if r in waiting:
                    self.versions[r] = [(0, version)]
                else:  # its cache holds what older weights computed: the prompt's K/V and its tokens' so far
                    self.versions[r].append((int(rows.ptr[r]), version))
            self.version = version
        if self.loop is None:  # the first run: the places, empty, take the first rows as any row is admitted
            w = self.waiting
            # the routers' recorder, as `sample`'s: a model without experts is refused here in one line
            replay = routing.of(model) if rows.route_width is not None else None
            if self.tp is not None or (self.static_cache and decodes_written_out(model) and w.images is None):
                steps = static_steps(model, w.ids[:0], w.attn[:0], w.positions[:0], self.max_new, self.places,
                                     replay is not None, self.tp, self.share, cuda_graph=self.cuda_graph,
                                     attention_kernel=self.attention_kernel, dtype=self.dtype)
                model.__dict__.pop("_static_decoder", None)  # the stream's own: another `sample` builds its own
            else:  # the model's own forward, on its live weights: nothing to copy at later runs
                steps = _HFSteps(model, w.ids[:0], w.attn[:0], w.positions[:0], self.max_new, replay)
            if not steps.dec.forgets_exactly and rows.respond is not None and self.max_turns > 1:
                self.check_every = 1  # recurrent states cannot forget a token sampled past a stop (as `sample`'s)
            rows.steps = steps
            pick = self.draw.whole if self.tp is None else \
                functools.partial(self.draw.sliced, tp=self.tp, vocab=steps.dec.vocab)
            # every row the stream can hold, through the places in turn: a bound no rank's rows reach (as `sample`'s)
            limit = iterations(self.capacity + self.places, self.places, self.max_new, self.max_turns, self.check_every)
            self.loop = _Loop(steps, rows, pick, self.check_every, True, limit)
            self.loop.logits = torch.zeros(0, device=self.device)
            self.loop.held = torch.zeros(0, dtype=torch.long, device=self.device), 0  # as at a check
        elif isinstance(self.loop.steps, _StaticSteps):
            self.loop.steps.dec.load(model)  # this version's weights, into the copies the cache was made with
        if isinstance(self.loop.steps, _StaticSteps):
            self.loop.steps.dec.first_slot = self.first_slot
        needed = np.array([self.slot[t] for t in tags], dtype=np.int64)
        all_done = all_done or (lambda done: bool(done.all()))
        # on the model's own forward its routers record while the stream runs (the training forward replays between)
        replay = self.loop.steps.replay
        if replay is not None:
            replay.record()
        try:
            self.loop.resume()
            if self.loop.run(lambda: all_done(torch.as_tensor(~rows.active[needed], device=self.device))):
                raise RuntimeError(f"the stream's rows did not end within {self.loop.limit} iterations")
        finally:
            if replay is not None:
                replay.stop()

    def take(self, tags):
        """The Rollout of the ended rows `tags`, in that order, with each token's version; the rows are freed."""
        slots = np.array([self.slot.pop(t) for t in tags], dtype=np.int64)
        if self.rows.active[slots].any():
            raise RuntimeError("a row taken from the stream has not ended")
        rollout = self.rows.rollout(slots)
        versions = np.zeros((len(slots), rollout.completion_ids.shape[1]), dtype=np.int64)
        for row, r in zip(versions, slots):
            for position, version in self.versions[r]:
                row[position:] = version
        rollout.versions = torch.as_tensor(versions, device=self.device) * rollout.policy_mask
        # the version that ran the row's prompt into its cache: the oldest K/V each of its tokens attends to
        rollout.context_version = torch.tensor([self.versions[r][0][1] for r in slots], device=self.device)
        self.free[slots] = True
        return rollout

    def close(self):
        """Free the decoder's copies and cache."""
        self.loop = self.rows.steps = None
