"""Which tokens' policy terms count (TRL's entropy and off-policy masks): --top_entropy_quantile keeps the tokens of
highest entropy, --off_policy_mask_threshold drops the sequences of negative advantage whose policy drifted too far
from the sampler's. Neither changes a normaliser (docs/objective.md: "Which tokens count").

Applied by features/apply.py: it replaces `run.select_tokens` (train.every_token: every token counts), whose
per-micro-batch `keep` the core hands to grpo.grpo_loss, and adds `kept_frac` to the step's metrics.
"""

import torch

import grpo
import sharding


def apply(run, core):
    """core: the module of the core step (train.py), whose forward without gradient the entropy quantile reads."""
    selection = TokenSelection(core)
    run.select_tokens = selection.start
    run.step_metrics.append(selection.metrics)


class TokenSelection:
    """The run's token selection: `start` before each update's first optimizer step (the entropy thresholds, at the
    weights that sampled), then `keep` for each micro-batch's loss. Counts the kept tokens of each update's last
    pass (`metrics`: kept_frac)."""

    def __init__(self, core):
        self.core, self.kept, self.tokens = core, {}, {}

    def start(self, run, batch, inputs, minis, entropies):
        """`run.select_tokens`: this update's `keep`. entropies: each mini-batch's, per micro-batch, at the weights
        that sampled, where the core read them (several mini-batches: train.before_first_step), else None; with
        top_entropy_quantile and one mini-batch, read here (one forward without gradient per micro-batch)."""
        cfg = run.cfg
        self.run, self.inputs, self.sampler = run, inputs, batch.rollout.logprobs
        self.kept, self.tokens = {}, {}  # (j, i) -> the micro-batch's; a later pass's replace an earlier's
        self.threshold = [None] * len(minis)  # each mini-batch's entropy quantile
        if cfg.top_entropy_quantile < 1:
            if entropies is None:
                entropies = [[e for _, e in self.core.sampling_logprobs(run, inputs["ids"], inputs["mask"], micro,
                                                                        inputs["extras"])] for micro in minis]
            self.threshold = [entropy_threshold(run, e, micro, inputs["loss_mask"])
                              for e, micro in zip(entropies, minis)]
        return self.keep

    def keep(self, j, i, mb, logp, entropy):
        """(m, T) / (m, 1) in {0, 1}: the tokens whose policy term counts in micro-batch (j, i). A mini-batch whose
        threshold is None (no counted token) keeps none."""
        cfg, mask = self.run.cfg, self.inputs["loss_mask"][mb.rows, :mb.t]
        keep = None
        if cfg.top_entropy_quantile < 1:
            threshold = self.threshold[j]
            keep = (grpo.high_entropy_mask(entropy.detach(), mask, threshold=threshold) if threshold is not None
                    else torch.zeros_like(mask))
        if cfg.off_policy_mask_threshold is not None:
            off = grpo.off_policy_mask(self.inputs["advantages"][mb.rows][:, None], logp,
                                       self.sampler[mb.rows, :mb.t], mask, cfg.off_policy_mask_threshold)
            keep = off if keep is None else keep * off
        self.kept[j, i], self.tokens[j, i] = (keep * mask).sum(), mask.sum()
        return keep

    def metrics(self, run, batch, step, so_far):
        """The share of the counted tokens kept, over every rank, in the step's last pass."""
        kept = tokens = 0.0
        for k in self.kept:  # in the order the update counted them
            kept, tokens = kept + self.kept[k], tokens + self.tokens[k]
        kept, tokens = sharding.all_reduce_sum([torch.as_tensor(x, dtype=torch.float64).item()
                                                for x in (kept, tokens)], run.d)
        self.inputs = self.sampler = None  # the step's tensors: not held through the next step's draw
        return {"kept_frac": kept / max(tokens, 1.0)}


def entropy_threshold(run, entropy, micro, loss_mask):
    """The (1 - top_entropy_quantile) quantile of the entropies (`entropy`, one per micro-batch, at the weights that
    sampled) of every counted token of `micro` (a mini-batch), on every rank, so that the tokens kept do not depend
    on how the mini-batch is split (TRL takes the quantile over each micro-batch). None without tokens."""
    cfg, d = run.cfg, run.d
    local = torch.cat([e[loss_mask[mb.rows, :mb.t] > 0] for e, mb in zip(entropy, micro)]).float()
    if d.world_size > 1:  # every rank's tokens, each rank's padded with NaN to the most any rank has
        most = int(sharding.all_gather_rows(torch.tensor([local.numel()], device=d.device), d).max().item())
        padded = torch.full((most,), float("nan"), device=local.device)
        padded[:local.numel()] = local
        local = sharding.all_gather_rows(padded, d)
        local = local[~torch.isnan(local)]
    return torch.quantile(local, 1 - cfg.top_entropy_quantile) if local.numel() else None
