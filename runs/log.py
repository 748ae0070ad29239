"""What a run writes for people to read: the step's metrics (reduced over ranks) and its line on stdout,
out_dir/metrics.jsonl, out_dir/config.json (and whether a run may continue the one it describes), wandb.

Only the master process writes. Every file that is rewritten (config.json, metrics.jsonl on resume) is written
to a temporary file first and renamed over the old one, so a kill at any moment leaves the old file or the new
one, never half of either.
"""

import dataclasses
import json
import math
import netrc
import os
from urllib.parse import urlparse

import torch

import grpo
import sharding
from runs import disk


def write_atomic(path, text):
    """Replace `path` with `text`: a temporary file in the same folder, flushed to disk, then renamed.

    A write the storage refuses (a full disk, ...) removes the temporary file, leaves `path` as it was and
    raises disk.WriteError."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        full = disk.check(e, path, "", then=f"{os.path.basename(path)} is as it was")
        if os.path.exists(tmp):
            os.remove(tmp)
        if full is not None:
            raise full from e
        raise


def strict_json(value):
    """NaN and infinities as null: json.dumps would write bare NaN / Infinity, which strict JSON readers reject."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _step_of(line):
    """The step of a metrics.jsonl line; None for a line cut short when a run was killed mid-write."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def duration(seconds):
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def wandb_key(key):
    """Dashboard sections: reward/..., perf/..., eval/..., train/..."""
    if key.startswith(("eval/", "train/", "perf/")):
        return key
    if key in ("step_time", "tokens_per_s", "generation_time", "update_time", "batch_tokens") or \
            key.split("/")[0] == "reward_time":
        return f"perf/{key}"
    if key.startswith("reward"):
        if key in (f"reward/{k}" for k in REWARD_TOTALS):  # a reward function named as a total's metric
            return f"{key}_fn"
        if key.startswith("reward_std/"):  # a function's spread, beside its mean in the reward section
            return f"reward/std/{key.removeprefix('reward_std/')}"
        return key if "/" in key else f"reward/{key}"
    return f"train/{key}"


REWARD_TOTALS = ("reward", "reward_std")  # the totals' metrics: on wandb reward/reward and reward/reward_std


def wandb_credentials():
    """True when wandb can log in without asking: an API key in the environment or in ~/.netrc for its host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class Logger:
    """The step line, metrics.jsonl and wandb (when asked for); a no-op outside the master process."""

    # what the step line shows, with short names, so that it fits a 120-column terminal (a long or uneven step's
    # time split and truncated share may push a line past it: a price worth paying where it shows)
    SHOWN = (("reward", "reward"), ("kl", "kl"), ("loss", "loss"), ("completion_length", "len"),
             ("entropy", "entropy"), ("grad_norm", "grad"), ("tool_calls", "tools"))

    def __init__(self, cfg, master, resume_step=0, run_id=None, moe=False, bf16=False):
        self.master, self.wandb, self.max_steps = master, None, cfg.max_steps
        self.mask_truncated, self.said = cfg.mask_truncated_completions, set()
        self.mismatch_warn, self.fixes = dict(cfg.mismatch_warn), mismatch_fixes(cfg, moe, bf16)
        if not master:
            return
        os.makedirs(cfg.out_dir, exist_ok=True)
        self.path = os.path.join(cfg.out_dir, "metrics.jsonl")
        # steps after the checkpoint we resume from are about to be redone: drop their lines, by writing the
        # kept ones to a new file that replaces the old one only once complete
        kept = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if _step_of(line) is not None and _step_of(line) <= resume_step]
            write_atomic(self.path, "".join(kept))
        # unbuffered: a line is on disk once log() returns, and one the disk refused leaves nothing to retry
        self.jsonl = open(self.path, "ab", buffering=0)
        if cfg.wandb_mode != "disabled":
            import wandb
            # A resumed run continues the same wandb run (its id is saved in the checkpoint).
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, mode=cfg.wandb_mode,
                                    dir=cfg.out_dir, config=cfg_dict(cfg), id=run_id, resume="allow")
            if run_id is not None and cfg.wandb_mode == "online":
                self.refill(kept)

    def refill(self, kept):
        """A resumed run's dashboard: a run killed hard loses the steps wandb had not yet sent, while metrics.jsonl
        has every one. The server says where the history it holds ends (the resumed run's `step`, its next); the
        lines of metrics.jsonl from there to the checkpoint are logged again, once, before the run goes on."""
        start = getattr(self.wandb, "step", 0) or 0
        for line in kept:
            metrics = json.loads(line)
            if metrics["step"] >= start:
                self.wandb.log({wandb_key(k): v for k, v in metrics.items() if k != "step" and v is not None},
                               step=metrics["step"])

    def log(self, metrics, eta=None):
        if not self.master:
            return
        self._append((json.dumps(strict_json(metrics)) + "\n").encode())
        parts = [f"step {metrics['step']:>{len(str(self.max_steps))}}/{self.max_steps}"]
        parts += [f"{short} {metrics[k]:.3g}" for k, short in self.SHOWN if k in metrics]
        if "dynamic/groups_kept" in metrics:  # dynamic sampling: groups with a signal / groups drawn
            parts.append(f"groups {metrics['dynamic/groups_kept']}/{metrics['dynamic/groups_drawn']}")
        parts += step_time(metrics)
        parts += [f"mismatch {k} {v:.3g}!" for k, v, _ in self.mismatched(metrics)]
        if eta is not None:
            parts.append(f"eta {duration(eta)}")
        print("\n".join([" | ".join(parts)] + [f"  note: {n}" for n in self.notes(metrics)]), flush=True)
        if self.wandb is not None:
            self.wandb.log({wandb_key(k): v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def mismatched(self, metrics):
        """[(metric, value, threshold)] of the step's sampler-trainer mismatch past --mismatch_warn (of the tokens
        drawn by the step's own weights: carried ones are off-policy by design): ess below its threshold, ppl_ratio
        farther from 1 than it, the others larger in magnitude."""
        out = []
        for k, limit in self.mismatch_warn.items():
            v = metrics.get(f"mismatch/{k}")
            if v is not None and (v < limit if k == "ess" else abs(v - 1 if k == "ppl_ratio" else v) > limit):
                out.append((k, v, limit))
        return out

    def notes(self, metrics):
        """What makes a step learn little, said under its step line the first time it happens in the run: most
        completions truncated and masked (no loss from them), most groups without a signal (equal rewards), or the
        sampler and the trainer disagreeing past --mismatch_warn (each metric once)."""
        notes = []
        new = [(k, v, limit) for k, v, limit in self.mismatched(metrics) if f"mismatch {k}" not in self.said]
        if new:
            self.said.update(f"mismatch {k}" for k, _, _ in new)
            notes.append("the sampler and the trainer disagree past --mismatch_warn: " + ", ".join(
                f"mismatch/{k} {v:.3g} ({'below' if k == 'ess' else 'past'} {limit:g})" for k, v, limit in new) +
                f"; {self.fixes}")
        if self.mask_truncated and metrics.get("truncated_frac", 0) > 0.5 and "masked" not in self.said:
            self.said.add("masked")
            notes.append(f"{metrics['truncated_frac']:.0%} of completions reached max_completion_length and "
                         f"mask_truncated_completions gives them no loss; a longer limit lets them end")
        elif metrics.get("truncated_frac", 0) > 0.5 and not self.said & {"masked", "cut"}:
            # a short, even step's line has no room for it (a long or uneven one shows `truncated N%`)
            self.said.add("cut")
            notes.append(f"{metrics['truncated_frac']:.0%} of completions were cut at max_completion_length "
                         f"(truncated_frac); a longer limit lets more of them end")
        if metrics.get("frac_reward_zero_std", 0) > 0.5 and "flat" not in self.said:
            self.said.add("flat")
            notes.append(f"{metrics['frac_reward_zero_std']:.0%} of groups have equal rewards, hence no advantage to "
                         f"learn from (frac_reward_zero_std)")
        return notes

    def _append(self, line):
        """One line onto metrics.jsonl, whole or not at all: a write the storage refuses (a full disk, ...) cuts
        the file back to the lines before it and raises disk.WriteError."""
        size = os.fstat(self.jsonl.fileno()).st_size
        try:
            view = memoryview(line)
            while view:  # an unbuffered write may take part of the line: a full disk, a signal
                view = view[self.jsonl.write(view):]
        except OSError as e:
            full = disk.check(e, self.path, "the step's metrics to",
                              then=f"{os.path.basename(self.path)} keeps the steps before it")
            self.jsonl.truncate(size)
            if full is not None:
                raise full from e
            raise

    def table(self, step, name, columns):
        """A wandb.Table from {column: values} (no-op without wandb); log it before the step's metrics."""
        if self.wandb is None:
            return
        import wandb
        if "image" in columns:  # pictures (arrays or PIL images) shown as pictures
            columns = {**columns, "image": [None if x is None else wandb.Image(x) for x in columns["image"]]}
        self.wandb.log({name: wandb.Table(columns=list(columns), data=[list(r) for r in zip(*columns.values())])},
                       step=step)

    def show_completions(self, run, step, batch, total, parts, advantages):
        """Some of the step's completions: a wandb table of the first four groups, a few printed lines."""
        cfg, G = run.cfg, run.cfg.num_generations
        if cfg.completions_table_every and step % cfg.completions_table_every == 0:
            shown = slice(0, min(len(batch.prompts), 4 * G))  # the first four groups, whole
            self.table(step, "completions", {
                "prompt": batch.prompts[shown], "completion": batch.completions[shown],
                **({"image": [first_image(batch.fields, i) for i in range(len(batch.prompts))[shown]]}
                   if "image" in batch.fields or "images" in batch.fields else {}),
                **{k: v[shown].tolist() for k, v in parts.items()},
                # with tools: each turn, call and result as its own message
                **({"conversation": [json.dumps(e.messages) for e in batch.episodes[shown]],
                    "turns": batch.rollout.turns[shown].tolist()} if batch.episodes else {}),
                "reward": total[shown].tolist(), "advantage": advantages[shown].tolist()})
        if run.d.master and cfg.print_completions_every and step % cfg.print_completions_every == 0:
            for i in range(0, min(len(batch.prompts), 3 * G), G):
                print(f"  [{total[i]:.2f}] {batch.prompts[i][-60:]!r} -> {batch.completions[i][:120]!r}"
                      + (f" ({batch.rollout.turns[i].item()} turns)" if batch.episodes else ""))

    def close(self):
        if self.master:
            self.jsonl.close()
            if self.wandb is not None:
                self.wandb.finish()


LONG_STEP = 5.0  # seconds: past this, where a step's time goes is worth a glance on every line
UNEVEN = 1.25    # the longest completion this many times the mean: the rollout waits for its longest rows


def step_time(metrics):
    """The step line's time: where it went and how many completions ran to the limit when the step is long or its
    completions uneven (some rows stop early, the step waits for those that run on), where a slow sampler, update
    or reward is otherwise invisible; else the step's seconds, with the rewards' where they take a good part."""
    t, rewards = metrics["step_time"], metrics.get("reward_time", 0)
    truncated = metrics.get("truncated_frac", 0)
    uneven = metrics.get("completion_length_max", 0) >= UNEVEN * max(metrics.get("completion_length", 0), 1)
    if t >= LONG_STEP or uneven:
        split = ", ".join(f"{name} {metrics[k]:.2f}s" for k, name in (
            ("generation_time", "generation"), ("reward_time", "rewards"), ("update_time", "update")) if k in metrics)
        return [f"{t:.2f}s ({split})"] + ([f"truncated {truncated:.0%}"] if truncated else []) + streaming(metrics)
    return [f"{t:.2f}s" + (f" (rewards {rewards:.2f}s)" if rewards >= max(0.1, 0.2 * t) else "")] + streaming(metrics)


def streaming(metrics):
    """The step line's streaming figures (--rollouts_in_flight, --max_staleness): the seconds the step waited for its
    rows, the share of decode place-steps at work, and the mean age of the tokens trained."""
    if "generation_wait_s" not in metrics:
        return []
    out = [f"wait {metrics['generation_wait_s']:.2f}s"]
    if "slots_busy" in metrics:
        out.append(f"busy {metrics['slots_busy']:.0%}")
    if "staleness_mean" in metrics:
        out.append(f"stale {metrics['staleness_mean']:.2f}")
    return out


def mismatch_fixes(cfg, moe, bf16):
    """What would act on a sampler-trainer mismatch in this run, in words: its causes among the settings, and the
    settings that correct for it that it does not use yet."""
    fixes = []
    if cfg.top_k or cfg.top_p < 1:
        fixes.append("top_k / top_p: the sampler draws from the filtered distribution, the trainer scores the whole")
    if cfg.importance_sampling == "none":
        fixes.append("--importance_sampling=token_truncate corrects the loss for it")
    if moe and not cfg.routing_replay:
        fixes.append("--routing_replay trains through the experts the sampler chose")
    if bf16:
        fixes.append("--mixed_precision=fp16 samples and trains in float16 (3 more mantissa bits), fp32 in float32")
    return "; ".join(fixes) or "no setting of this run acts on it: look at the sampler's kernels"


def first_image(fields, i):
    """Row i's picture for the completions table: its `image`, or the first of its `images`; None without one."""
    image = fields.get("image", [None] * (i + 1))[i]
    images = fields.get("images", [None] * (i + 1))[i]
    if image is None and images is not None and len(images):
        image = images[0]
    return image


def count(n):
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


CPU_PARAMETERS = 100_000_000  # past this a model trains too slowly on a CPU to be worth it (the banner says so)


def banner(run, resumed):
    """A few lines on what is about to run (a train.Run), where, and where its output goes."""
    cfg, d, lm = run.cfg, run.d, run.policy.lm
    total = sum(p.numel() for p in lm.parameters())
    trainable = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    device = f"{d.device}" + (" (no CUDA GPU found)" if cfg.device == "auto" and d.device.type == "cpu" else "")
    threads = torch.get_num_threads()
    data = (f"{len(run.task.rows):,} rows of {cfg.dataset or 'the task dataset'}" if run.task.rows is not None
            else "prompts generated in code")
    funcs = ", ".join(f"{getattr(f, '__name__', type(f).__name__)} ({w:g})"
                      for f, w in zip(run.task.reward_funcs, run.weights))
    reference = ("none (beta 0)" if cfg.beta == 0 else "the policy without adapters" if cfg.lora_rank else
                 f"copy mixed toward the policy every {cfg.ref_model_sync_steps} optimizer steps (alpha "
                 f"{cfg.ref_model_mixup_alpha:g})" if cfg.sync_ref_model else "frozen copy")
    if cfg.ref_bf16 and cfg.beta > 0 and not cfg.lora_rank:  # its log-probs, and so the KL, are bfloat16 weights'
        reference = reference.replace("copy", "copy in bfloat16 (--ref_bf16)", 1)
    mesh = f" as {d.describe()}" if d.replicas > 1 or d.nodes > 1 else ""  # several nodes, or HSDP's copies
    minis = f" in {cfg.steps_per_generation} mini-batches" if cfg.steps_per_generation > 1 else ""
    from layers import lora  # here, not at the top: the rest of this file has no use for torch
    adapted = lora.lora_summary(lm)  # which layers, how many of each: "all" differs by family
    lines = [
        f"device {device} x {d.world_size} process(es){mesh}, {threads} CPU thread(s) each | out_dir {cfg.out_dir}",
        f"model {cfg.model} ({type(lm).__name__}): {count(total)} parameters, {count(trainable)} trainable | "
        f"reference: {reference}",
        f"paths: {run.paths}{' | routing replay' if cfg.routing_replay else ''}",
        *([adapted] if adapted else []),
        f"task {cfg.task}: {data} | rewards: {funcs}",
        f"{cfg.prompts_per_step} prompts x {cfg.num_generations} completions per step{minis}, micro-batches of "
        f"{cfg.micro_batch_size}, up to {cfg.max_completion_length} new tokens, {cfg.max_steps} steps",
    ]
    if resumed["path"]:
        lines.append(f"resuming from {resumed['path']} (step {resumed['step']}, saved by {resumed['world_size']} "
                     f"process(es), now {d.world_size})")
    metrics = os.path.join(cfg.out_dir, "metrics.jsonl")
    if not resumed["path"] and os.path.exists(metrics) and os.path.getsize(metrics):
        lines.append(f"warning: {metrics} holds steps of an earlier run but out_dir has no checkpoint to resume from "
                     f"(--save_every 0?): starting over at step 1 and replacing them")
    busy = busy_cpu(threads)
    if d.device.type == "cpu" and busy:  # threads that wait for a busy core: docs/runs.md "A machine others use too"
        lines.append(f"warning: {busy}: {threads} threads wait for each other; --threads=1 may be much faster")
    if d.device.type == "cpu" and total > CPU_PARAMETERS:  # what a recipe names does not matter: the model's size
        lines.append(f"warning: {cfg.model} has {count(total)} parameters: on the CPU each step will be very slow "
                     f"(a GPU: torchrun --nproc_per_node 1 train.py ...)")
    return "\n".join(lines)


def busy_cpu(threads):
    """What says the cores are busy with other work, if they are: the load average, less the one process this
    run is (busy importing and loading until now), leaves fewer idle cores than `threads`; else None."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not on every platform
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    others = load - 1
    if threads > 1 and others >= 1 and cores - others < threads:
        return f"the CPU is busy (load {load:.1f} on {cores} cores)"
    return None


def step_metrics(run, batch, sums, all_total, parts, all_adv, group_std):
    """The step's metrics over all ranks (docs/metrics.md), from this rank's sums (those named "max/...": its largest
    values, which reduce to the largest over the ranks) and reward parts, and every rank's rewards and advantages."""
    d, G = run.d, run.cfg.num_generations
    maxima = [k for k in sums if k.startswith("max/")]
    high = sharding.all_gather_rows(torch.tensor([[sums[k] for k in maxima]], dtype=torch.float64, device=d.device), d)
    seen = batch.prompt_mask.sum().item() + batch.rollout.completion_ids.numel()
    sums = dict(zip(list(sums) + ["seen"], sharding.all_reduce_sum(list(sums.values()) + [seen], d)))
    sums.update(zip(maxima, high.amax(0).tolist()))
    lengths = sharding.all_gather_rows(batch.rollout.completion_mask.sum(1).float(), d)  # policy + environment
    policy_lengths = sharding.all_gather_rows(batch.rollout.policy_mask.sum(1).float(), d)
    truncated = sharding.all_gather_rows(batch.rollout.truncated.float(), d)
    parts = {k: sharding.all_gather_rows(v, d) for k, v in parts.items()}
    tok = max(sums["tokens"], 1.0)

    def mean(x):  # over the completions some function scored; NaN where none did
        x = x[~torch.isnan(x)]
        return x.mean().item() if x.numel() else float("nan")

    def std(x):  # the same completions' spread (Bessel-corrected, as torch.std; 0 for one value)
        x = x[~torch.isnan(x)]
        return x.std().item() if x.numel() > 1 else 0.0 if x.numel() else float("nan")
    ended = lengths[truncated == 0]  # the completions that ended on their own (EOS or a stop), not at the limit
    return {
        "reward": mean(all_total), **{f"reward/{k}": mean(v) for k, v in parts.items()},
        **{f"reward_std/{k}": std(v) for k, v in parts.items()},
        "reward_std": group_std.mean().item(),
        "frac_reward_zero_std": (all_adv.view(-1, G).abs().sum(1) == 0).float().mean().item(),
        "loss": sums["loss"], "kl": sums["kl"] / tok, "clip_low": sums["clip_low"] / tok,
        "clip_high": sums["clip_high"] / tok, "clip_region": (sums["clip_low"] + sums["clip_high"]) / tok,
        "entropy": sums["entropy"] / tok,
        "completion_length": lengths.mean().item(), "completion_length_min": lengths.min().item(),
        "completion_length_max": lengths.max().item(), "completion_policy_length": policy_lengths.mean().item(),
        **({"completion_length_ended": ended.mean().item(), "completion_length_ended_min": ended.min().item(),
            "completion_length_ended_max": ended.max().item()} if ended.numel() else {}),
        "truncated_frac": truncated.mean().item(),
        "batch_tokens": sums["seen"], **sampler_metrics(sums),
        **{k: v for more in run.update_metrics for k, v in more(sums).items()},  # a feature's, of the sums it added
    }


def tool_metrics(run, batch, step, so_far):
    """Tool calls and failed calls per completion, and the turns a completion took (mean and most), over every
    rank: what a run with tools or an environment adds to the step's metrics (features/apply.py)."""
    d = run.d
    turns = sharding.all_gather_rows(batch.rollout.turns.float(), d)
    counts = torch.tensor([[e.tool_calls, e.tool_errors] for e in batch.episodes], dtype=torch.float32,
                          device=d.device)
    counts = sharding.all_gather_rows(counts, d)
    return {"tool_calls": counts[:, 0].mean().item(), "tool_errors": counts[:, 1].mean().item(),
            "turns": turns.mean().item(), "turns_max": turns.max().item()}


def sampler_metrics(sums):
    """The sampler against the trainer, from the step's sums over every rank: the mean |trainer - sampler| log-prob
    of the sampled tokens before any update (numerics, not learning) and its largest, and the mismatch figures
    (grpo.mismatch_metrics)."""
    out = {"sampler_logprob_diff_mean": sums["lp_diff_sum"] / max(sums["lp_diff_tokens"], 1.0),
           "sampler_logprob_diff_max": sums["max/lp_diff"]}
    part = {k.rsplit("/", 1)[1]: v for k, v in sums.items() if k.startswith("mismatch_sum/fresh/")}
    out.update({f"mismatch/{k}": v for k, v in grpo.mismatch_metrics(part).items()} if part else {})
    return out


# ----------------------------------------------------------------------------- out_dir/config.json


def cfg_dict(cfg):
    return dataclasses.asdict(cfg)


def read_saved_config(out_dir):
    """The config.json an earlier run left in out_dir, or None; a damaged one is named, not ignored."""
    path = os.path.join(out_dir, "config.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
        return saved
    except ValueError as e:
        raise ValueError(f"out_dir: {path} cannot be read ({e}); move it away to continue or start a run there") from e


def write_config(cfg):
    write_atomic(os.path.join(cfg.out_dir, "config.json"), json.dumps(strict_json(cfg_dict(cfg)), indent=1) + "\n")


def changed_keys(saved, cfg, keys):
    """[(key, saved value, new value)] for the run-defining keys whose value differs."""
    now = strict_json(cfg_dict(cfg))
    return [(k, saved.get(k), now[k]) for k in keys if k in saved and saved[k] != now[k]]


def start_problem(cfg, d, run_keys):
    """Why this run may not start (None if it may), decided on the master before any model is loaded and told
    to every rank: out_dir holds a run whose `run_keys` settings differ, or wandb would ask for a login."""
    problem = None
    if d.master and cfg.wandb_mode == "online" and not wandb_credentials():
        problem = ("wandb: --wandb_mode=online needs credentials and this machine has none: run `wandb login` or "
                   "set WANDB_API_KEY, or use --wandb_mode=offline")
    elif d.master:
        try:
            saved = read_saved_config(cfg.out_dir)
        except ValueError as e:
            return sharding.broadcast_object(str(e), d)
        has_run = saved is not None or bool(sharding.checkpoint_dirs(cfg.out_dir))
        if cfg.resume == "never" and has_run:
            problem = (f"out_dir {cfg.out_dir} already holds a run and --resume=never: use another --out_dir "
                       f"to start a new one")
        elif cfg.resume == "auto" and saved is not None:
            changes = changed_keys(saved, cfg, run_keys)
            # a --dataset's training rows are those not held out, and how many are held out depends on two settings
            held = [c["eval_prompts"] if c.get("dataset") and c.get("eval_every") else 0 for c in (saved, cfg_dict(cfg))]
            if cfg.eval_only:  # evaluating only: the rows it holds out are not trained on now
                held[1] = held[0]
            if "eval_prompts" in saved and held[0] != held[1]:
                changes.append(("eval_prompts", f"{held[0]} rows held out", f"{held[1]} rows held out"))
            if changes:
                problem = "\n".join(
                    [f"out_dir {cfg.out_dir} holds a run with other settings:"] +
                    [f"  --{k}: {old!r} there, {new!r} now" for k, old, new in changes] +
                    ["Use another --out_dir to start a new run, or add --resume=force to continue this one with "
                     "the new settings."])
    return sharding.broadcast_object(problem, d)
