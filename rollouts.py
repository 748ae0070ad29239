"""A step's data: the sampled trajectories (`Rollout`), a step's rows on one process with their prompts, data and
text (`Batch`), how several of either are joined and rows taken out of them, and what reward functions get of them.
The sampler (sampling.py) makes Rollouts; the step (train.py) makes Batches of them, scores, joins and shares them.

Shapes: N rows (completions), T completion positions, S prompt positions.
"""

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import rewards


@dataclass
class Rollout:
    """The sampled trajectories: every (N, T) field is padded on the right, every field has one row per completion.

    A field added here is carried through `cat_rollouts` without more code: (N, T, ...) fields are padded
    along T with 0 (or with their metadata's pad value, on its side), (N,) fields concatenated; an optional
    field is None in every part or in none.
    """
    completion_ids: torch.Tensor = field(metadata={"pad": "pad_id"})  # (N, T) the policy's tokens and the
                                   # environment's answers in order, pad after the end
    completion_mask: torch.Tensor  # (N, T) 1 for every real token (the policy's and the environment's), 0 for padding
    policy_mask: torch.Tensor      # (N, T) 1 for the tokens the policy sampled: the only ones the loss trains on
    truncated: torch.Tensor        # (N,) True when the length limit cut the trajectory before it ended
    logprobs: torch.Tensor         # (N, T) float32 log-prob of each sampled token (temperature applied), 0 elsewhere
    turns: torch.Tensor            # (N,) long: the policy's turns, 1 + the environment's answers
    # with routing replay (layers/routing.py), the experts each token was routed to when it was fed, int16, -1 where
    # none was recorded: the completion's (N, T, layers, k) and the left-padded prompt's (N, P, layers, k)
    routing: torch.Tensor = field(default=None, metadata={"pad": -1})
    prompt_routing: torch.Tensor = field(default=None, metadata={"pad": -1, "side": "left"})
    # (N, T) long, from a Stream only: the version of the weights (the training steps taken before) that drew each
    # policy token; a row that decoded through a training step has tokens of two versions or more
    versions: torch.Tensor = None
    # (N,) long, from a Stream only: the version that ran the row's prompt into its cache, the oldest weights whose
    # K/V every token of the row attends to (features/streaming.py's `carried`)
    context_version: torch.Tensor = None
    # (N,) long: the decode iterations the row held a place in the batch (before it ended, and after until its place
    # was given to another row or compacted away); the policy's tokens over their sum is the share of the batch's
    # place-steps that did work (`slots_busy`)
    held_steps: torch.Tensor = None

    def to(self, device):
        return Rollout(**{f.name: _map(getattr(self, f.name), lambda x: x.to(device))
                          for f in dataclasses.fields(self)})


def _map(x, fn):
    return None if x is None else fn(x)


def completion_id_lists(rollout):
    """Each trajectory's token ids without padding (the policy's and an environment's), as reward functions
    get them (`completion_ids`, as in TRL)."""
    return [row[keep].tolist() for row, keep in zip(rollout.completion_ids.cpu(), rollout.completion_mask.cpu().bool())]


def reward_fields(fields, completion_ids, episodes, tokenizer=None, prompts=None, completions=None):
    """What reward functions get of each completion besides its prompt and text: the row's data, the
    trajectory's ids (lists, `completion_id_lists`), with an agent the conversation and the environment, and with
    the tokenizer the completion's parts (its final content, reasoning and tool calls: responses.reward_parts)."""
    out = {**fields, "completion_ids": completion_ids}
    if episodes is not None or getattr(tokenizer, "response_template", None) is not None:
        return turn_fields(out, episodes, tokenizer, prompts, completions)
    return out if tokenizer is None else {**out, **plain_parts(tokenizer, completion_ids, completions)}


def turn_fields(out, episodes, tokenizer, prompts, completions):
    """reward_fields `out` with turns to read: with an agent the conversation and the environment, and with the
    tokenizer the parts of a tool episode's turns, or a response template's (reasoning, tool calls)."""
    import environments
    from environments import responses
    if episodes is not None:
        out.update(environments.episode_fields(episodes))
    if tokenizer is not None:
        out.update(responses.reward_parts(tokenizer, prompts, out["completion_ids"], episodes, completions))
    return out


def plain_parts(tokenizer, completion_ids, completions=None):
    """responses.reward_parts of completions with no turns to read (no episode, no response template): each one
    assistant message, its text as written (`completions`, where given, else decoded without special tokens), no
    reasoning and no tool call."""
    texts = completions if completions is not None else \
        [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
    return {"completion_messages": [[{"role": "assistant", "content": t}] for t in texts],
            "completion_content": list(texts), "reasoning_content": [""] * len(texts),
            "tool_calls": [[] for _ in texts]}


def reward_context(cfg, step):
    """The run-level keywords every reward function gets besides the data (rewards.score_completions)."""
    return {"step": step, "max_completion_length": cfg.max_completion_length,
            "soft_punish_cache": getattr(cfg, "soft_punish_cache", 0)}


def score_batch(batch, reward_funcs, weights, tokenizer, context, seconds=None):
    """The rewards of a Batch's completions, each function given what `reward_fields` says:
    rewards.score_completions' (total (n,), {function: (n,)}); `seconds` collects each function's time."""
    fields = reward_fields(batch.fields, completion_id_lists(batch.rollout), batch.episodes, tokenizer, batch.prompts,
                           batch.completions)
    return rewards.score_completions(reward_funcs, weights, batch.prompts, batch.completions, fields,
                                     seconds=seconds, context=context)


def cat_rollouts(rollouts, pad_id):
    """One Rollout of the rows of several, in order; shorter completions padded on the right."""
    if len(rollouts) == 1:
        return rollouts[0]
    return Rollout(**{f.name: _cat_field(f, [getattr(r, f.name) for r in rollouts], pad_id)
                      for f in dataclasses.fields(Rollout)})


def _cat_field(f, parts, pad_id):
    """Rollout field `f`'s `parts` joined (None where they are None): (N, T, ...) ones padded along T to the
    widest with 0 or their metadata's pad value, on its side (right unless "left")."""
    if parts[0] is None:
        return None
    if parts[0].dim() >= 2:
        value = pad_id if f.metadata.get("pad") == "pad_id" else f.metadata.get("pad", 0)
        t = max(x.shape[1] for x in parts)
        left = f.metadata.get("side") == "left"
        # F.pad's widths run from the last dimension back: (0, 0) for each dimension after the second
        parts = [F.pad(x, (0, 0) * (x.dim() - 2) + ((t - x.shape[1], 0) if left else (0, t - x.shape[1])),
                       value=value) for x in parts]
    return torch.cat(parts)


def rollout_rows(rollout, index):
    """The Rollout of rows `index` (a list or tensor of row numbers) of `rollout`, in that order."""
    index = torch.as_tensor(index, dtype=torch.long, device=rollout.completion_ids.device)
    return Rollout(**{f.name: _map(getattr(rollout, f.name), lambda x: x[index.to(x.device)])
                      for f in dataclasses.fields(Rollout)})


@dataclass
class Rows:
    """A batch's rows on this rank before they are sampled: each prompt's G rows, with their seeds."""
    prompts: list                       # (n,) prompt text as the policy sees it
    fields: dict                        # {column: (n,) values}: the rows' other data, for the reward functions
    mine: slice                         # this rank's rows of all the processes' rows
    prompt_ids: torch.Tensor            # (n, S) left-padded
    prompt_mask: torch.Tensor           # (n, S)
    seeds: torch.Tensor                 # (n,) long: each row's random numbers (sampling.row_keys)
    episodes: list = None               # (n,) environments.Episode with an agent, else None
    images: object = None               # vision.PromptImages of the rows' prompts, or None

    def sampled(self, rollout, completions, landing=None):
        """The Batch of these rows with their sampled `rollout` and its text."""
        return Batch(self.prompts, self.fields, self.mine, self.prompt_ids, self.prompt_mask, rollout, completions,
                     self.episodes, self.images, landing)


@dataclass
class Batch:
    """One step's rows on this rank: prompts, their data and the sampled completions."""
    prompts: list                       # (n,) prompt text as the policy saw it
    fields: dict                        # {column: (n,) values}: the rows' other data, for the reward functions
    mine: slice                         # this rank's rows of the step's N = P * G
    prompt_ids: torch.Tensor            # (n, S) left-padded
    prompt_mask: torch.Tensor           # (n, S)
    rollout: Rollout                    # completion ids (n, T), masks, log-probs, truncation, turns
    completions: list                   # (n,) completion text: the whole trajectory, tool calls and results included
    episodes: list = None               # (n,) environments.Episode: each rollout's conversation, with tools
    images: object = None               # vision.PromptImages of the rows' prompts (a vision-language model's), or None
    landing: object = None              # Landing: the rewards of the groups scored as they landed, or None


def cat_scored(scored, pad_id):
    """One scored batch of the rows of several (batch, total, parts), in order: prompts left-padded, completions
    right-padded to the widest."""
    batches = [b for b, _, _ in scored]
    S = max(b.prompt_ids.shape[1] for b in batches)
    left = lambda x, value: torch.nn.functional.pad(x, (S - x.shape[1], 0), value=value)  # noqa: E731
    batch = Batch(prompts=sum((b.prompts for b in batches), []),
                  fields={k: sum((b.fields[k] for b in batches), []) for k in batches[0].fields},
                  mine=None,
                  prompt_ids=torch.cat([left(b.prompt_ids, pad_id) for b in batches]),
                  prompt_mask=torch.cat([left(b.prompt_mask, 0) for b in batches]),
                  rollout=cat_rollouts([b.rollout for b in batches], pad_id),
                  completions=sum((b.completions for b in batches), []),
                  episodes=None if batches[0].episodes is None else sum((b.episodes for b in batches), []))
    return (batch, torch.cat([t for _, t, _ in scored]),
            {k: torch.cat([p[k] for _, _, p in scored]) for k in scored[0][2]})


def take_rows(scored, rows, mine):
    """Rows `rows` (a list) of a scored batch, as the batch `mine` of a step: (batch, total, parts)."""
    batch, total, parts = scored
    index = torch.tensor(rows, dtype=torch.long)
    on = lambda x: x[index.to(x.device)]  # noqa: E731
    return (Batch(prompts=[batch.prompts[i] for i in rows], mine=mine,
                  fields={k: [v[i] for i in rows] for k, v in batch.fields.items()},
                  prompt_ids=on(batch.prompt_ids), prompt_mask=on(batch.prompt_mask),
                  rollout=rollout_rows(batch.rollout, index),
                  completions=[batch.completions[i] for i in rows],
                  episodes=None if batch.episodes is None else [batch.episodes[i] for i in rows]),
            on(total), {k: on(v) for k, v in parts.items()})
