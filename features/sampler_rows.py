"""The sampler's rows with every optional feature (sampling.py's `_Rows` is the core's: single-turn rows that end
at EOS or at the length limit, all in the batch from the prefill): turns answered by an environment and stop
sequences (`_answer`, `feed`'s blocks, rows at positions of their own in `draw`), an environment's tokens and each
row's turns in the rollout, rows streaming through fewer places (`Waiting`, `admit`, `_feed_heads`, the rows of a
`Stream`), rows handed on as they end (`on_end`) and the routing recorded for each row (`keep_routes`).
features/sampler_options.py's Sampler and features/stream_sampler.py's Stream make them.
"""

import numpy as np
import torch
import torch.nn.functional as F

from rollouts import Rollout
from sampling import ENVIRONMENT, Turn, _Rows, _first_stop


class Waiting:
    """The rows of a `sample` call that wait for a place in the batch: the first `places` rows start in it, the
    others (`rows`, in order) take the places of rows that end. positions: every row's prompt positions (N, P);
    images: their vision.PromptImages, or None."""

    def __init__(self, ids, attn, positions, places, images=None):
        self.ids, self.attn, self.positions, self.places = ids, attn, positions, places
        self.images = images  # every row's vision.PromptImages, or None
        self.rows = list(range(places, ids.shape[0]))

    def prompts(self, rows):
        """Each row's prompt tokens, its padding left out."""
        real = self.attn[torch.as_tensor(rows, device=self.ids.device)].bool()
        return [ids[keep].tolist() for ids, keep in zip(self.ids[torch.as_tensor(rows, device=self.ids.device)], real)]


class Rows(_Rows):
    """`_Rows` with turns, stop sequences, admission, on_end and routing records.

    Where rows are at positions of their own (after answers of different lengths, or rows admitted), the state the
    core keeps on the host is copied to the device (`device_state`) and kept there.
    """

    def __init__(self, steps, n, max_new, eos_ids, pad_id, device, waiting, keys, stop_sequences=(), respond=None,
                 max_turns=1, on_end=None, first=None):
        super().__init__(steps, max_new, eos_ids, pad_id, keys)
        self.waiting = waiting  # the rows not yet in the batch, which takes the first `waiting.places`
        # the batch starts with rows 0 .. first - 1 (`first`: every place, unless a Stream starts it empty)
        first = waiting.places if first is None else first
        self.rows_h, self.rows = np.arange(first), torch.arange(first, device=device)
        self.feed_h, self.live = np.full(first, -1, dtype=np.int64), np.arange(first)
        self.kind = torch.zeros(n, max_new + 1, dtype=torch.int8, device=device)  # ENVIRONMENT where an answer went
        self.turns = np.ones(n, dtype=np.int64)
        self.device_state = {}  # ptr, active and feed on the device, for steps where rows are at different positions
        self.tag = np.arange(n)  # what on_end and a Stream's caller call each row
        self.respond, self.max_turns = respond, max_turns
        self.turn_start = np.zeros(n, dtype=np.int64)
        self.on_end, self.ended = on_end, []  # rows ended since the last check, for on_end
        # the blocks to feed with the batch's next tokens, [(row, first position, token ids)]: environments' answers
        # (`_answer`) and admitted rows' prompts (`admit`), fed by `feed`
        self.feeds = []
        self.stops = [tuple(int(t) for t in s) for s in stop_sequences if len(s)]
        self.longest_stop = max((len(s) for s in self.stops), default=1)
        self.triggers = torch.tensor(sorted(self.eos | {s[-1] for s in self.stops}), dtype=torch.long, device=device)
        # routing replay: the prompts' width where the steps record each token's experts, else None; `routes`, the
        # records of each row (prompt, completion), taken from its place before the place takes another row
        self.route_width, self.routes, self.kept = None, None, np.zeros(n, dtype=bool)  # kept: final records taken

    def draw(self, logits, draw):
        """A token for every batch row at its position: (tokens, their column: an int shared by all, or per row)."""
        rows_h, rows, spare, keys = self.rows_h, self.rows, self.spare, self.keys
        if self.uni is not None or len(rows_h) == 0:  # plain columns, host bookkeeping only
            return super().draw(logits, draw)
        self.held[rows_h] += 1
        # rows at their own positions (after answers of different lengths): the same on the device. Where each
        # row's token goes: an active row's next position; a finished row (ended at or before its position)
        # writes past its end, in step with the others, up to the spare column
        act_h = self.active[rows_h]
        cols_h = np.where(act_h, self.ptr[rows_h], np.minimum(self.feed_h + 1, spare))
        state = self.device_state
        if not state:
            # copies (torch.tensor): on the CPU, as_tensor would share the host arrays' memory
            state.update(ptr=torch.tensor(self.ptr, device=self.device),
                         active=torch.tensor(self.active, device=self.device),
                         feed=torch.tensor(self.feed_h, device=self.device))
        act = state["active"][rows]
        col = torch.where(act, state["ptr"][rows], (state["feed"] + 1).clamp(max=spare))
        tok, lp = draw(logits, keys[rows, col])
        self.tokens[rows, col], self.logps[rows, col] = tok, lp
        state["feed"] = col
        state["ptr"][rows] += act
        self.feed_h = cols_h
        self.ptr[self.live] += 1
        return tok, col

    def finish(self, global_rows, cut):
        super().finish(global_rows, cut)
        self.device_state.clear()
        if self.on_end is not None:
            self.ended += [int(r) for r in np.atleast_1d(global_rows)]

    def check(self, tok, final=False):
        """`_Rows.check`, the rows ended there then handed on (`landed`): their completions are final."""
        super().check(tok, final)
        self.landed()

    def landed(self):
        """Hand the rows ended since the last check, with their completions, to on_end."""
        if self.ended:
            rows, self.ended = sorted(self.ended), []
            ids = self.tokens[torch.as_tensor(rows, device=self.device), :int(self.ptr[rows].max())].tolist()
            self.on_end(self.tag[rows].tolist(), [row[:self.ptr[r]] for r, row in zip(rows, ids)])

    def _stops(self):
        """{global row: the position its turn ended at} over the positions since each row's last check."""
        if not self.stops:  # EOS only: each row's first one, found on the device
            return super()._stops()
        live = self.rows_h[self.active[self.rows_h]]
        found = {}
        if not len(live):
            return found
        checked, ptr, device = self.checked, self.ptr, self.device
        since = checked[live] - (self.longest_stop - 1)
        lo = int(np.maximum(since, self.turn_start[live]).min())
        hi = int(ptr[live].max())
        window = self.tokens[torch.as_tensor(live, device=device), lo:hi]
        hit = self._hits(live, lo, hi, since)
        # a stop sequence ends at the trigger: rows with one are scanned in Python
        any_hit = hit.any(1).tolist()
        for r, seq in zip(live[np.flatnonzero(any_hit)], window[torch.tensor(any_hit, device=device)].tolist()):
            e = _first_stop(seq, lo, int(checked[r]), int(ptr[r]), int(self.turn_start[r]), self.eos, self.stops)
            if e is not None:
                found[r] = e
        checked[live] = ptr[live]
        return found

    def _answer(self, found, tok):
        """End the turns `found` ends: a row with turns left asks `respond`, and takes its answer (a block to feed),
        or ends; the others end."""
        if not found:
            return
        ptr, device = self.ptr, self.device
        ended = np.array(sorted(found))
        ends = np.array([found[r] + 1 for r in ended])
        old_ptr = ptr[ended].copy()
        # what a row sampled past its stop is forgotten: past its length it is padding in the rollout, and
        # is overwritten if the row goes on; a row that may go on also stops attending to it
        ptr[ended], self.checked[ended] = ends, ends
        self.device_state.clear()
        asking = ended[self.turns[ended] < self.max_turns] if self.respond is not None else ended[:0]
        batch_of = np.full(self.n, -1)
        batch_of[self.rows_h] = np.arange(len(self.rows_h))
        if len(asking):
            self.steps.truncate(torch.as_tensor(batch_of[asking], device=device),
                                torch.as_tensor(ptr[asking], device=device))
        self.finish(ended[~np.isin(ended, asking)], False)
        if not len(asking):
            return
        so_far = self.tokens[torch.as_tensor(asking, device=device), :int(ptr[asking].max())].tolist()
        answers = self.respond([Turn(int(r), ids[:ptr[r]], int(self.turn_start[r])) for r, ids in zip(asking, so_far)])
        if len(answers) != len(asking):
            raise ValueError(f"respond returned {len(answers)} answers for {len(asking)} turns")
        for r, answer in zip(asking, answers):
            answer = [int(t) for t in answer] if answer is not None else []
            if not answer:
                self.finish([r], False)
                continue
            at = int(ptr[r])
            if at + len(answer) >= self.max_new:  # no room left for the policy to answer back
                self.finish([r], True)
                continue
            self.tokens[r, at:at + len(answer)] = torch.tensor(answer, device=device)
            self.kind[r, at:at + len(answer)] = ENVIRONMENT
            # the token that ended the turn is fed with the answer unless an earlier step fed it
            unfed = found[r] == old_ptr[np.searchsorted(ended, r)] - 1
            block = ([int(tok[batch_of[r]])] if unfed else []) + answer
            self.feeds.append((int(r), at - 1 if unfed else at, block))
            ptr[r] = self.checked[r] = self.turn_start[r] = at + len(answer)
            self.turns[r] += 1

    def schedule(self, tok, col, compact):
        """After a check, the places of ended rows to the rows waiting (`admit`), or with none waiting `_Rows`'s
        compaction."""
        if not self.waiting.rows:
            return super().schedule(tok, col, compact)
        tok = self.admit(tok)
        self.realign()
        return tok, col

    def realign(self):
        super().realign()
        if self.uni is not None:
            self.device_state.clear()  # the shared-position steps keep the host's state only

    def admit(self, tok):
        """Give the batch places whose rows ended, then places never used yet (up to `waiting.places`), to the rows
        waiting, in order: each place forgets its row (steps.admit) and its new row's prompt is fed as an
        environment's answer is (`feeds`). Returns the batch's tokens, with a pad for each new place."""
        free = np.flatnonzero(~self.active[self.rows_h])[:len(self.waiting.rows)]
        grow = min(self.waiting.places - len(self.rows_h), len(self.waiting.rows) - len(free))
        if grow > 0:  # a Stream's batch before its places have all been taken
            free = np.concatenate([free, len(self.rows_h) + np.arange(grow)])
            self.rows_h = np.concatenate([self.rows_h, np.full(grow, -1)])
            self.rows = torch.cat([self.rows, self.rows.new_zeros(grow)])
            self.feed_h = np.concatenate([self.feed_h, np.full(grow, -1)])
            tok = torch.cat([tok, tok.new_full((grow,), self.pad_id)])
        if not len(free):
            return tok
        self.keep_routes(free[self.rows_h[free] >= 0])
        new = np.array([self.waiting.rows.pop(0) for _ in free])
        free_t, new_t = torch.as_tensor(free, device=self.device), torch.as_tensor(new, device=self.device)
        self.rows_h[free], self.rows[free_t] = new, new_t
        if self.waiting.images is None:
            self.steps.admit(free_t, self.waiting.positions[new_t])
        else:  # the model's own forward: the new rows' images enter their prompts' prefill
            self.steps.admit(free_t, self.waiting.positions[new_t], self.waiting.images.rows(new))
        self.device_state.clear()
        self.feeds += [(int(r), -len(prompt), prompt) for r, prompt in zip(new, self.waiting.prompts(new))]
        return tok

    def keep_routes(self, places):
        """Routing replay: keep the experts recorded for the rows in batch places `places` (an array) by row, as
        they are now: a row's are final once it ended, and taken once then."""
        if self.route_width is None:
            return
        places = places[~self.kept[self.rows_h[places]]]
        if not len(places):
            return
        prompt, comp = self.steps.routed(self.route_width, self.max_new, torch.as_tensor(places, device=self.device))
        if self.routes is None:
            self.routes = [torch.full((self.n, *x.shape[1:]), -1, dtype=x.dtype, device=x.device)
                           for x in (prompt, comp)]
        rows = torch.as_tensor(self.rows_h[places], device=self.device)
        self.routes[0][rows], self.routes[1][rows] = prompt, comp
        self.kept[self.rows_h[places]] = ~self.active[self.rows_h[places]]

    def compact(self, tok, col):
        self.keep_routes(np.flatnonzero(~self.active[self.rows_h]))  # before their places may be dropped
        self.device_state.clear()
        return super().compact(tok, col)

    def feed(self, logits, tok, col):
        """The batch's next logits: its tokens fed (a decode step), with the blocks in `feeds` (an extend step)."""
        feeds, self.feeds = self.feeds, []
        if len(self.rows_h) == 0 or not feeds:
            return super().feed(logits, tok, col)
        place = {int(r): i for i, r in enumerate(self.rows_h)}  # each row's place in the batch
        feeds = [(place[r], first, block) for r, first, block in feeds]
        long = [(i, first, block) for i, first, block in feeds if len(block) > 1]
        if self.steps.prompts_alone:  # new rows' prompts alone (first < 0), answers with the batch
            long = [(i, first, block) for i, first, block in long if first < 0]
            if long:
                feeds = self._feed_heads(long, feeds)
        elif long and self.steps.feeds_rows and (len(long) < len(self.rows_h) or self.steps.share):
            feeds = self._feed_heads(long, feeds)
        k = max(len(b) for _, _, b in feeds)
        ids = F.pad(tok[:, None], (0, k - 1), value=self.pad_id)
        valid = torch.zeros_like(ids, dtype=torch.bool)
        valid[:, 0] = True
        start = self.feed_h.copy()  # each row's first position in the block; the others feed their one token
        for i, first, block in feeds:
            ids[i, :len(block)] = torch.tensor(block, device=self.device)
            valid[i, len(block):] = False
            valid[i, :len(block)] = True
            start[i], self.feed_h[i] = first, first + len(block) - 1
        self.device_state.clear()
        return self.steps.extend(ids, valid, torch.as_tensor(start, device=self.device), int(self.feed_h.max()))

    def _feed_heads(self, long, feeds):
        """Feed the blocks of `long` (a new row's prompt, an environment's answer) but their last tokens, on their
        batch rows alone: an extend step computes each of its rows' widest block, so the batch's other rows would
        compute that width for their one token. The feeds left: every row's one token (a block's last). With the
        steps' `share`, a new row whose prompt another row runs now, or (without recurrent layers, whose states
        move on) a live row holds, takes a copy of that row's prompt cache instead of running it (its prompt's last
        token it feeds itself)."""
        rest = {i: (i, first + len(block) - 1, block[-1:]) for i, first, block in long}
        share = getattr(self.steps, "share", False)
        copies, runs, alone = [], ({} if not share else self._held_prompts({i for i, _, _ in long})), []
        for i, first, block in long:
            # first < 0: a new row's prompt (`admit`); every prompt ends at the slot before completion position 0
            key = (first, tuple(block)) if first < 0 and share else None
            if key in runs:
                copies.append((runs[key], i, first))
                continue
            if key is not None:
                runs[key] = i
            alone.append((i, first, block))
        if not alone:  # every new row's prompt is held by a live row
            self.steps.copy_rows(*(torch.as_tensor([c[j] for c in copies], device=self.device) for j in (0, 1)),
                                 min(c[2] for c in copies), -2)
            return [rest.get(i, (i, first, block)) for i, first, block in feeds]
        k = max(len(block) for _, _, block in alone) - 1
        ids = torch.full((len(alone), k), self.pad_id, dtype=torch.long, device=self.device)
        valid = torch.zeros_like(ids, dtype=torch.bool)
        for j, (_, _, block) in enumerate(alone):
            ids[j, :len(block) - 1] = torch.tensor(block[:-1], device=self.device)
            valid[j, :len(block) - 1] = True
        start = np.array([first for _, first, _ in alone])
        top = max(first + len(block) - 2 for _, first, block in alone)
        self.steps.extend(ids, valid, torch.as_tensor(start, device=self.device), top,
                          torch.as_tensor([i for i, _, _ in alone], device=self.device))
        if copies:  # each prompt's slots but its last (the slots before them: empty in both rows)
            src, dst = (torch.as_tensor([c[j] for c in copies], device=self.device) for j in (0, 1))
            self.steps.copy_rows(src, dst, min(c[2] for c in copies), -2)
        return [rest.get(i, (i, first, block)) for i, first, block in feeds]

    def _held_prompts(self, fed):
        """{(first, prompt tokens): batch row} of the live rows not fed now, whose caches hold their prompts, where a
        new row may copy them: none with recurrent layers (a live row's state is past its prompt)."""
        if self.steps.dec.recurrent:
            return {}
        live = [b for b in range(len(self.rows_h)) if b not in fed and self.active[self.rows_h[b]]]
        held = {}
        for b, prompt in zip(live, self.waiting.prompts(self.rows_h[live]) if live else []):
            held.setdefault((-len(prompt), tuple(prompt)), b)
        return held

    def rollout(self, rows=None):
        """The Rollout of rows `rows` (an array of row indices; all by default), in that order: an environment's
        tokens in it are not the policy's, and the routing recorded for the rows is in it."""
        device = self.device
        rows = np.arange(self.n) if rows is None else np.asarray(rows)
        ptr = self.ptr[rows]
        index = slice(None) if len(rows) == self.n and (rows == np.arange(self.n)).all() else \
            torch.as_tensor(rows, device=device)
        t = max(1, int(ptr.max()) if len(rows) else 1)
        real = torch.arange(t, device=device) < torch.as_tensor(ptr, device=device)[:, None]  # (N, T)
        policy = real & (self.kind[index, :t] != ENVIRONMENT)
        out = Rollout(completion_ids=self.tokens[index, :t].masked_fill(~real, self.pad_id),
                      completion_mask=real.long(), policy_mask=policy.long(),
                      truncated=torch.as_tensor(self.truncated[rows], device=device),
                      logprobs=self.logps[index, :t].masked_fill(~policy, 0.0),
                      turns=torch.as_tensor(self.turns[rows], device=device),
                      held_steps=torch.as_tensor(self.held[rows], device=device))
        if self.route_width is not None:  # the rows still in their places first
            self.keep_routes(np.flatnonzero(np.isin(self.rows_h, rows)))
        if self.routes is not None:
            out.prompt_routing = self.routes[0][index].clone()  # index may be every row: not a view of ours
            # past a row's end the rows were fed what they sampled after finishing: nothing to replay there
            out.routing = self.routes[1][index, :real.shape[1]].masked_fill(~real[:, :, None, None], -1)
        return out
