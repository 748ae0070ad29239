"""The sampler's optional features, applied to sampling.py's core loop from outside: `Options`, the Sampler that
`sampling.sample` runs when a caller asks for any of them, `sample` (sampling.sample with every feature as a
keyword) and `generate`, a step's rollout with the run's features on (batches of generation_batch_size, a
tensor-parallel group, an agent's turns, rows streaming through places, shared prompts, the Triton decode
attention, routing records, image prompts, rows handed on as they end).

A run that asks for any of them (`asked`) samples its steps with them from the start: features/apply.py applies
`apply` below, which sets the run's rollout (`sampled`: `sample_rows` here) and the rows it samples (`run.rows_of`:
`rows_of` here where the prompts start an agent's turns or hold images); its evaluation picks the same (`chosen`).
The core's sampling.rows_of and sampling.sample_rows know none of them.
"""

import functools
import sys

import torch

import logprobs
import sharding
from layers import routing, transformer, vision
from layers.engine import StaticDecoder
import rollouts
from rollouts import cat_rollouts
import sampling
from sampling import Draw, Sampler, _HFSteps, _image_prefill, _Loop, _StaticSteps, _text, encode_prompts, group_share
from features.sampler_rows import Rows, Waiting


@torch.no_grad()
def sample(model, prompt_ids, prompt_mask, *, max_new_tokens, eos_ids, pad_id, draw=None, seeds=None, check_every=8,
           all_done=None, static_cache=True, compact=True, cuda_graph=True, keep_decoder=False,
           attention_kernel=False, stop_sequences=(), respond=None, max_turns=1, record_routing=False, images=None,
           tp=None, dtype=None, in_flight=0, on_end=None, share_prompts=False, **options):
    """sampling.sample with its optional features as keywords (`Options`'s); draw, or its fields as keywords
    (`options`: temperature, top_k, top_p).

    A row pauses at its first EOS or at the end of one of `stop_sequences` (lists of token ids). Without `respond`,
    or after `max_turns` turns, a pause ends the row. Otherwise `respond(turns)` is called with a `Turn` per paused
    row and returns, for each, the environment's answer as token ids, or None to end the row; the answer is appended
    to the row's cache (a prefill of those tokens only) and the row samples on. A completion holds at most
    `max_new_tokens` tokens, the answers included: an answer that leaves no room for another token ends the row as
    truncated. What a row sampled past its pause is forgotten: dropped from the completion, its cache slots no
    longer attended. Rows with equal seeds, prompts and answers sample equal completions, whatever their batch.
    Pauses and answers make no collective call.
    """
    if draw is not None and options:
        raise TypeError(f"sample: a draw and its fields {sorted(options)} given apart; put them in the Draw")
    sampler = Options(model, static_cache=static_cache, compact=compact, cuda_graph=cuda_graph,
                      keep_decoder=keep_decoder, attention_kernel=attention_kernel, stop_sequences=stop_sequences,
                      respond=respond, max_turns=max_turns, record_routing=record_routing, images=images, tp=tp,
                      dtype=dtype, in_flight=in_flight, on_end=on_end, share_prompts=share_prompts)
    return sampling.sample(sampler, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                           pad_id=pad_id, draw=draw or Draw(**options), seeds=seeds, all_done=all_done,
                           check_every=check_every)


class Options(Sampler):
    """The Sampler of a `sample` call with optional features.

    static_cache: where the run's decision (transformer.paths_of) says so, run the steps on `StaticDecoder` (a
    preallocated cache, no per-token framework overhead); other models, or static_cache=False, on the model's own
    forward (hf_decoder.HFDecoder). compact: at each check, drop finished rows from the batch (on the model's own
    forward, only where rows stream through places).
    cuda_graph: on CUDA, replay each decode step as a captured CUDA graph. keep_decoder: keep StaticDecoder's weight
    copies, cache and graphs on the model for the next call (no re-copy or re-capture), at the price of that memory
    between calls. attention_kernel: on CUDA, StaticDecoder's decode attention runs as the split-KV Triton kernel of
    layers/kernels.py instead of SDPA (where the shapes allow it). stop_sequences, respond, max_turns: turns
    answered by an environment (`sample`'s). record_routing: record each token's experts in every MoE layer
    (layers/routing.py) into the rollout's `routing` and `prompt_routing` (the model's own forward, which routes
    through its routers). images: the rows' vision.PromptImages (a vision-language model's image prompts), on the
    model's own forward: their embeddings and rotary positions enter the prefill. tp: this rank's share of a
    tensor-parallel group (layers/tensor_parallel.py) whose ranks all call `sample` with the same rows:
    StaticDecoder holds this rank's slice of every layer and of the vocabulary, cut from the model (from its FSDP2
    shards where it is sharded: layers/tensor_parallel.py's `Slice.take`), and the group's ranks sample the same
    tokens. dtype: the decoder's copies' dtype (the model's own by default; a sharded model's compute dtype).
    in_flight: decode `in_flight` rows at a time and stream the others through their places: when a row ends, its
    place takes the next row (`Rows.admit`), the routing recorded for the row kept (its last token, which the place
    may not feed before it is taken or compacted away, may record none); 0: every row at once. on_end(rows, ids):
    called at each check with the rows that ended there (indices into the batch given) and their completions' token
    ids (lists, the environment's answers included), while the other rows decode on; a row's completion is final
    then. share_prompts: on StaticDecoder, rows with the same prompt are prefilled once (`StaticDecoder.prefill`'s
    share).
    """

    def __init__(self, model, *, static_cache=True, compact=True, cuda_graph=True, keep_decoder=False,
                 attention_kernel=False, stop_sequences=(), respond=None, max_turns=1, record_routing=False,
                 images=None, tp=None, dtype=None, in_flight=0, on_end=None, share_prompts=False):
        super().__init__(model)
        self.static_cache, self.compact, self.keep_decoder = static_cache, compact, keep_decoder
        self.decoder = dict(cuda_graph=cuda_graph, attention_kernel=attention_kernel, dtype=dtype)
        self.stop_sequences, self.respond, self.max_turns = stop_sequences, respond, max_turns
        self.images, self.in_flight, self.on_end, self.share = images, in_flight, on_end, share_prompts
        self.sliced = tp is not None and tp.size > 1
        self.tp = tp if self.sliced else None  # None: each rank decodes alone, on whole layers
        self.replay = routing.of(model) if record_routing else None
        if self.replay is None and routing.attached(model) is not None:  # routers left replaying a training
            routing.attached(model).stop()  # forward's choice
        self.streams = False

    def steps(self, ids, attn, max_new):
        """The steps the first `in_flight` rows (every row without it) start on: StaticDecoder where the run's
        decision (transformer.paths_of) says so and static_cache allows, always for a tensor-parallel share; else the
        model's own forward (a vision-language model's language model under our masks, never written-out layers: the
        run's paths refuse the decoder for it, as its language model is not where a decoder's layers are). The others
        wait (`Waiting`) for the places of rows that end."""
        n = ids.shape[0]
        places = self.in_flight if 0 < self.in_flight < n else n
        self.streams = places < n
        self.waiting = waiting = Waiting(ids, attn, logprobs.position_ids_from_mask(attn), places,
                                          self.images if places < n else None)
        model, tp, images, k = self.model, self.tp, self.images, waiting.places
        ids, attn, positions = waiting.ids[:k], waiting.attn[:k], waiting.positions[:k]
        paths = transformer.paths_of(model, tp.size if tp else 1)  # the run's, decided once at setup
        if tp:
            why = paths.sampler or ("images in prompts" if images is not None else None)
            if why:
                raise ValueError(f"tensor-parallel decoding over {tp.size} ranks: {why}")
        if tp or (self.static_cache and paths.samples_written_out()):
            return static_steps(model, ids, attn, positions, max_new, len(ids), self.replay is not None, tp,
                                self.share, **self.decoder)
        prefill = None if images is None else _image_prefill(model, ids, attn, images.rows(slice(0, len(ids))))
        return _HFSteps(model, ids, attn, positions, max_new, self.replay, prefill)

    def loop(self, steps, keys, max_new, eos_ids, pad_id, draw, check_every):
        """The loop over `steps` and its rows (`Rows`: turns, stop sequences, rows waiting for places, on_end,
        routing records), the draw on a tensor-parallel share's slice of the vocabulary, and the bound on its
        iterations that turns and places make (`iterations`)."""
        waiting = self.waiting
        rows = Rows(steps, len(keys), max_new, eos_ids, pad_id, keys.device, waiting, keys, self.stop_sequences,
                    self.respond, self.max_turns, self.on_end)
        rows.route_width = waiting.ids.shape[1] if self.replay is not None else None
        # a recurrent state cannot forget what a row sampled past its stop (the decoder's forgets_exactly is False
        # with recurrent layers): look at rows after every token, so that none samples past one (the same on every
        # rank: it depends on the model alone)
        if not steps.dec.forgets_exactly and self.respond is not None and self.max_turns > 1:
            check_every = 1
        # sliced, each rank holds a slice of the logits
        pick = functools.partial(draw.sliced, tp=self.tp, vocab=steps.dec.vocab) if self.sliced else draw.whole
        limit = iterations(len(keys), waiting.places, max_new, self.max_turns, check_every)
        return _Loop(steps, rows, pick, check_every, self.compact and (steps.compacts or self.streams), limit)

    def close(self):
        if self.replay is not None:
            self.replay.stop()
        if not self.keep_decoder:
            super().close()


def static_steps(model, ids, attn, positions, max_new, batch, record, tp, share, cuda_graph=True,
                 attention_kernel=False, dtype=None):
    """sampling._StaticSteps on the model's decoder for `batch` rows (StaticDecoder.for_model with these options;
    tp: a tensor-parallel share, or None), recording each token's experts where `record` says so
    (StaticDecoder.record, before the prefill)."""
    sliced = {} if tp is None else dict(tp=tp, device=ids.device)  # a group's share: on the rows' device
    dec = StaticDecoder.for_model(model, batch, ids.shape[1] + max_new + 1, cuda_graph=cuda_graph, dtype=dtype,
                                  **sliced)
    dec.use_kernel(attention_kernel)
    dec.record(record)  # routing replay: each token's experts, kept by the decoder per cache slot
    return (_SharedSteps if share else _StaticSteps)(dec, ids, attn, positions)


class _SharedSteps(_StaticSteps):
    """_StaticSteps whose rows with the same prompt run it once (--shared_prompts: layers/shared_prefill.py), and
    whose rows admitted with the same prompt share one's run (the features' rows, `share`)."""

    share = True

    def __init__(self, dec, ids, attn, positions):
        from layers import shared_prefill
        self.dec, self.p = dec, ids.shape[1]
        self.first_logits = shared_prefill.prefill(dec, ids, attn, positions) if len(ids) else None


def iterations(n, places, max_new, max_turns, check_every):
    """A rank-independent bound on a `sample` call's iterations: a row is active for at most max_new of them, plus
    what it re-samples after each pause it resumes from (at most check_every - 1 positions, max_turns - 1 times);
    rows streaming through fewer places take turns, each admitted at a check (list scheduling: at most the rows per
    place, plus one)."""
    limit = max_new + (max_turns - 1) * (check_every - 1)
    return limit if places >= n else (-(-n // places) + 1) * (limit + check_every)


# ----------------------------------------------------------------------------- a step's rollout


def sample_rows(policy, tokenizer, rows, draw, cfg, d, eos_ids, agent=None, record_routing=False, on_end=None):
    """sampling.sample_rows with the run's features on: the rollouts.Batch of `rows` (rollouts.Rows; their images,
    where `rows_of` below made them), sampled by `generate` in eval mode, an `agent` (environments.Agent) answering
    the rows' turns, each token's experts recorded where `record_routing` says so, on_end as `sample`'s."""
    was_training = policy.training
    policy.eval()
    rollout, completions = generate(policy, tokenizer, rows.prompt_ids, rows.prompt_mask, rows.seeds, draw, cfg, d,
                                    eos_ids, agent, rows.episodes, record_routing=record_routing, images=rows.images,
                                    on_end=on_end)
    policy.train(was_training)
    return rows.sampled(rollout, completions)


def generate(policy, tokenizer, prompt_ids, prompt_mask, seeds, draw, cfg, d, eos_ids, agent=None, episodes=None,
             record_routing=False, images=None, on_end=None):
    """Sample one completion per row on the gathered weights, each token drawn as `draw` (a Draw) says; return the
    rollout and the completions' text. Rows are decoded `cfg.generation_batch_size` at a time (all at
    once when 0; the KV cache holds that many rows; a row draws the same random numbers whatever batch it is in, so
    the setting changes memory and speed, not the completions, up to rounding where bf16 logits depend on the batch
    size; every rank has as many rows, so as many batches), on a tensor-parallel group's slices of the layers, with
    an `agent` (environments.Agent) answering row i's turns as `episodes[i]`'s conversation up to
    `agent.max_turns`, `images` (the rows' vision.PromptImages) and on_end(rows, ids) (`sample`'s, over these rows;
    each rank alone on the whole model: a tensor-parallel group's sampling does not call it)."""
    n = prompt_ids.shape[0]
    size = _batch_size(cfg, n)
    parts = []
    tp = getattr(d, "tp", None)
    if tp is not None and tp.size > 1:  # the group's ranks decode their rows together on slices of the layers
        for s in range(0, n, size):
            rows = slice(s, s + size)
            parts.append(_group_sample(policy, tokenizer, prompt_ids[rows], prompt_mask[rows], seeds[rows], draw,
                                       cfg, d, eos_ids, agent, None if agent is None else episodes[rows],
                                       record_routing, keep_decoder=s + size < n))
    else:
        with sharding.gathered(policy):  # full weights once for the whole decode loop
            parts = _whole_sample(policy, tokenizer, prompt_ids, prompt_mask, seeds, draw, cfg, d, eos_ids,
                                  agent, episodes, record_routing, images, on_end)
    rollout = cat_rollouts(parts, tokenizer.pad_token_id)
    if agent is not None:
        agent.finish(episodes, rollout)
    return rollout, _text(policy, tokenizer, rollout)


def _batch_size(cfg, n):
    """The rows of one `sample` call: all of them where they stream through `cfg.rollouts_in_flight` places, else
    batches of generation_batch_size (0: all)."""
    return n if cfg.rollouts_in_flight else cfg.generation_batch_size or n


def _whole_sample(policy, tokenizer, prompt_ids, prompt_mask, seeds, draw, cfg, d, eos_ids, agent, episodes,
                  record_routing, images, on_end=None):
    """`generate`'s batches, each rank alone on the whole model (gathered by the caller)."""
    n = prompt_ids.shape[0]
    size = _batch_size(cfg, n)
    parts = []
    for s in range(0, n, size):
        rows = slice(s, s + size)
        turns = {} if agent is None else dict(respond=agent.responder(episodes[rows]), max_turns=agent.max_turns,
                                              stop_sequences=agent.stop_sequences)
        parts.append(policy(sample, prompt_ids[rows], prompt_mask[rows], max_new_tokens=cfg.max_completion_length,
                            eos_ids=eos_ids, pad_id=tokenizer.pad_token_id, draw=draw, seeds=seeds[rows],
                            all_done=sharding.all_done_fn(d),
                            # the next batch reuses the weight copies and the cache
                            keep_decoder=s + size < n, attention_kernel=cfg.decode_attention_kernel,
                            record_routing=record_routing, in_flight=cfg.rollouts_in_flight,
                            on_end=on_end and (lambda rows, ids, s=s: on_end([r + s for r in rows], ids)),
                            share_prompts=cfg.shared_prompts,
                            images=None if images is None else images.rows(rows), **turns))
    return parts


def _group_sample(policy, tokenizer, prompt_ids, prompt_mask, seeds, draw, cfg, d, eos_ids, agent, episodes,
                  record_routing, keep_decoder):
    """This rank's rows of one batch decoded by its tensor-parallel group (`d.tp`): the group's rows gathered
    (layers/tensor_parallel.py's `group_rows`), sampled together on slices of the layers, and this rank's rows taken
    back, as wide as they would be alone. Rows draw their own random numbers, so they sample what they would alone.
    With an agent each rank answers its own rows' turns and the group shares the answers (`group_respond`)."""
    tp, n = d.tp, prompt_ids.shape[0]
    ids, mask, seeds, pad = tp.group_rows(prompt_ids, prompt_mask, seeds, tokenizer.pad_token_id)
    turns = {} if agent is None else dict(respond=tp.group_respond(agent.responder(episodes), n),
                                          max_turns=agent.max_turns, stop_sequences=agent.stop_sequences)
    dtype = sharding.mixed_precision_dtypes(cfg.mixed_precision, d.device)[0]
    rollout = sample(policy.lm, ids, mask, max_new_tokens=cfg.max_completion_length, eos_ids=eos_ids,
                     pad_id=tokenizer.pad_token_id, draw=draw, seeds=seeds, all_done=sharding.all_done_fn(d),
                     keep_decoder=keep_decoder, attention_kernel=cfg.decode_attention_kernel,
                     record_routing=record_routing, tp=tp, dtype=dtype, in_flight=cfg.rollouts_in_flight * tp.size,
                     share_prompts=cfg.shared_prompts, **turns)
    return group_share(rollout, tp, n, pad)


def rows_of(prompt_rows, G, d, tokenizer, cfg, seed_of, agent=None, images=None):
    """sampling.rows_of with an agent (each rollout's environment made and reset on the rank that samples it: every
    rank's prompts are tokenized apart) or a vision.ImageEncoder `images` (each prompt's images processed once, its
    placeholders widened to their tokens; the rows' vision.PromptImages with them): this rank's rollouts.Rows of
    `prompt_rows`, G of each (sampling.spread)."""
    rows, mine, fields, seeds = sampling.spread(prompt_rows, G, d, seed_of)
    if agent is None:
        prompts = [r["prompt"] for r in rows]
        texts, pictures = images(rows, prompts)
        pictures = pictures.rows(range(len(rows))[mine]).to(d.device)
        enc = encode_prompts(tokenizer, texts, cfg, d.device)
        return rollouts.Rows(prompts[mine], fields, mine, enc.input_ids[mine], enc.attention_mask[mine], seeds, None,
                             pictures)
    if images is not None and any(vision.row_images(r) for r in rows[mine]):
        raise ValueError("prompts with images and tools or an environment together are not supported")
    prompts, episodes = agent.start(rows[mine])
    enc = encode_prompts(tokenizer, prompts, cfg, d.device)
    return rollouts.Rows(prompts, fields, mine, enc.input_ids, enc.attention_mask, seeds, episodes, None)


# ----------------------------------------------------------------------------- the run's choice


def asked(cfg, d, agent=None, images=None):
    """Whether a run with these settings (or its evaluation) samples with the features here: an agent's turns,
    prompts with images, a tensor-parallel group, batches of generation_batch_size, rows streaming through places,
    shared prompts or the Triton decode attention."""
    tp = getattr(d, "tp", None)
    return agent is not None or images is not None or (tp is not None and tp.size > 1) or \
        bool(cfg.generation_batch_size or cfg.rollouts_in_flight or cfg.shared_prompts or cfg.decode_attention_kernel)


def chosen(cfg, d, agent=None, images=None):
    """The functions that make the rows of a run with these settings and sample them, as sampling.rows_of and
    sampling.sample_rows are called: the core's where it asks for no feature here (`asked`), else `rows_of` (where
    its prompts start an agent's turns or hold images) and `sample_rows` above with the run's agent."""
    make = sampling.rows_of if agent is None and images is None else \
        functools.partial(rows_of, agent=agent, images=images)
    return make, functools.partial(sample_rows, agent=agent) if asked(cfg, d, agent, images) else sampling.sample_rows


def apply(run, core):
    """A run's rollout with the features here (features/apply.py applies it where `asked`, or where the rollout
    records routing, --routing_replay): its rows made as `chosen` says (`run.rows_of`, which train.step_rows calls),
    sampled by `sampled`. core: the module of the core step (train.py)."""
    run.rows_of = chosen(run.cfg, run.d, run.agent, run.images)[0]
    run.rollout = lambda run, step, round=0: sampled(run, core.step_rows(run, step, round))


def sampled(run, rows, on_end=None):
    """train.rollout's batch of `rows` with the run's features: `sample_rows` with its agent, its `sample_options`
    (routing records) and on_end (`sample`'s)."""
    return sample_rows(run.policy, run.tokenizer, rows, Draw.of(run.cfg), run.cfg, run.d, run.eos_ids, run.agent,
                       on_end=on_end, **run.sample_options)


sampling.OPTIONS = sys.modules[__name__]  # what sampling.py's off-path callers reach through sampling._options
