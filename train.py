"""GRPO training, top to bottom: config, setup, then the loop.

    python train.py                                   # the tiny offline default, on CPU, a few minutes
    python train.py --model=Qwen/Qwen2.5-0.5B-Instruct --task=... --lr=1e-6
    torchrun --nproc_per_node 8 train.py --model=... --task=...

Every Config field below can be set as --key=value.
"""

import dataclasses
import json
import math
import os
import random
import sys
import time
import typing
from dataclasses import dataclass, field

import torch

import grpo
import model_loading
import rewards
import sharding


@dataclass
class Config:
    # model
    model: str = "tiny"                   # local folder or hub id; "tiny" builds a 2-layer byte-level model
    model_init_kwargs: dict = field(default_factory=lambda: {"attn_implementation": "sdpa"})  # no dtype: bf16 on CUDA, fp32 on CPU
    gradient_checkpointing: bool = False  # recompute each layer in backward: less activation memory, ~1/3 more compute
    device: str = "auto"                  # auto (cuda when available), cpu or cuda
    # task and rewards
    task: str = "next_letter"             # where prompts come from and how they are scored (rewards.get_task)
    reward_weights: list = field(default_factory=list)  # one per reward function, comma-separated; empty = all 1
    # batch
    num_generations: int = 8              # G, completions per prompt
    prompts_per_step: int = 16            # prompts per optimizer step, over all processes
    micro_batch_size: int = 16            # completions per forward/backward (gradient accumulation)
    num_iterations: int = 1               # mu: optimizer steps on each generated batch
    # optimisation
    lr: float = 1e-3
    lr_schedule: str = "constant"         # constant, linear or cosine (to 0 at max_steps, after warmup)
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    max_grad_norm: float = 1.0
    # objective
    beta: float = 0.04                    # KL coefficient; 0 builds no reference model
    epsilon: float = 0.2                  # clip range below: ratio >= 1 - epsilon
    epsilon_high: typing.Optional[float] = None  # clip range above (DAPO's clip-higher); None = epsilon
    loss_type: str = "grpo"               # grpo (per-sequence mean), dapo (token-level), dr_grpo (constant)
    scale_rewards: str = "group"          # group, batch or none: what the centred reward is divided by
    mask_truncated_completions: bool = False  # completions without EOS get no loss (DAPO)
    # sampling
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                        # 0 = off
    max_completion_length: int = 4
    max_prompt_length: int = 512          # longer prompts are cut from the left
    # run
    seed: int = 0
    max_steps: int = 300
    out_dir: str = "out"
    log_every: int = 1
    print_completions_every: int = 50     # print a few sampled completions every N steps; 0 = never
    wandb_project: str = "grpo"
    wandb_run_name: typing.Optional[str] = None
    wandb_mode: str = "disabled"          # disabled, offline (no account needed) or online


# ----------------------------------------------------------------------------- config parsing


class ConfigError(SystemExit):
    def __init__(self, key, message):
        super().__init__(f"config error: --{key}: {message}")


def _cast(key, value, typ):
    origin = typing.get_origin(typ)
    if origin is typing.Union:  # Optional[X]
        if value.lower() in ("none", "null", ""):
            return None
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    try:
        if typ is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ in (int, float, str):
            return typ(value)
        if typ is dict:
            parsed = json.loads(value)
            if not isinstance(parsed, dict):
                raise ValueError
            return parsed
        if typ is list:
            return [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        pass
    expected = {dict: "a JSON object", list: "comma-separated numbers"}.get(typ, getattr(typ, "__name__", str(typ)))
    raise ConfigError(key, f"expected {expected}, got {value!r}")


def parse_config(argv):
    cfg = Config()
    hints = typing.get_type_hints(Config)
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(arg.lstrip("-").split("=")[0] or arg, f"arguments are --key=value, got {arg!r}")
        key, value = arg[2:].split("=", 1)
        if key not in hints:
            raise ConfigError(key, f"unknown key (known: {', '.join(hints)})")
        setattr(cfg, key, _cast(key, value, hints[key]))
    validate(cfg)
    return cfg


def validate(cfg, world_size=1):
    def need(ok, key, message):
        if not ok:
            raise ConfigError(key, message)
    need(cfg.num_generations >= 2, "num_generations", f"must be >= 2 to compare completions within a group, got {cfg.num_generations}")
    need(cfg.prompts_per_step >= 1, "prompts_per_step", f"must be >= 1, got {cfg.prompts_per_step}")
    need(cfg.prompts_per_step * cfg.num_generations % world_size == 0, "prompts_per_step",
         f"{cfg.prompts_per_step} prompts x {cfg.num_generations} generations do not split evenly over {world_size} processes")
    need(cfg.micro_batch_size >= 1, "micro_batch_size", f"must be >= 1, got {cfg.micro_batch_size}")
    need(cfg.num_iterations >= 1, "num_iterations", f"must be >= 1, got {cfg.num_iterations}")
    need(cfg.lr > 0, "lr", f"must be > 0, got {cfg.lr}")
    need(cfg.lr_schedule in ("constant", "linear", "cosine"), "lr_schedule", f"constant, linear or cosine, got {cfg.lr_schedule!r}")
    need(cfg.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {cfg.warmup_steps}")
    need(cfg.beta >= 0, "beta", f"must be >= 0, got {cfg.beta}")
    need(0 < cfg.epsilon < 1, "epsilon", f"must be in (0, 1), got {cfg.epsilon}")
    need(cfg.epsilon_high is None or cfg.epsilon_high > 0, "epsilon_high", f"must be > 0, got {cfg.epsilon_high}")
    need(cfg.loss_type in grpo.LOSS_TYPES, "loss_type", f"one of {', '.join(grpo.LOSS_TYPES)}, got {cfg.loss_type!r}")
    need(cfg.scale_rewards in ("group", "batch", "none"), "scale_rewards", f"group, batch or none, got {cfg.scale_rewards!r}")
    need(cfg.temperature > 0, "temperature", f"must be > 0 for training, got {cfg.temperature}")
    need(0 < cfg.top_p <= 1, "top_p", f"must be in (0, 1], got {cfg.top_p}")
    need(cfg.top_k >= 0, "top_k", f"must be >= 0, got {cfg.top_k}")
    need(cfg.max_completion_length >= 1, "max_completion_length", f"must be >= 1, got {cfg.max_completion_length}")
    need(cfg.max_prompt_length >= 1, "max_prompt_length", f"must be >= 1, got {cfg.max_prompt_length}")
    need(cfg.max_steps >= 1, "max_steps", f"must be >= 1, got {cfg.max_steps}")
    need(cfg.log_every >= 1, "log_every", f"must be >= 1, got {cfg.log_every}")
    need(cfg.print_completions_every >= 0, "print_completions_every", f"must be >= 0, got {cfg.print_completions_every}")
    need(cfg.wandb_mode in ("disabled", "offline", "online"), "wandb_mode", f"disabled, offline or online, got {cfg.wandb_mode!r}")
    need(cfg.device in ("auto", "cpu", "cuda") or cfg.device.startswith("cuda:"), "device", f"auto, cpu or cuda, got {cfg.device!r}")
    need(isinstance(cfg.model_init_kwargs, dict), "model_init_kwargs", "must be a JSON object")
    need(cfg.model_init_kwargs.get("device_map") is None, "model_init_kwargs",
         "device_map is not accepted: the trainer places the model (one device per process)")


def lr_factor(cfg, opt_step, total_opt_steps):
    """Multiplier on cfg.lr at optimizer step `opt_step` (0-based)."""
    if opt_step < cfg.warmup_steps:
        return (opt_step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = (opt_step - cfg.warmup_steps) / max(1, total_opt_steps - cfg.warmup_steps)
    if cfg.lr_schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ----------------------------------------------------------------------------- logging


class Logger:
    """stdout line, out_dir/metrics.jsonl, and wandb when asked for; only the master process writes."""

    def __init__(self, cfg, master):
        self.master, self.wandb = master, None
        if not master:
            return
        os.makedirs(cfg.out_dir, exist_ok=True)
        self.jsonl = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a")
        if cfg.wandb_mode != "disabled":
            import wandb
            # mode offline needs no account; online without credentials fails here instead of prompting
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, mode=cfg.wandb_mode,
                                    dir=cfg.out_dir, config=dataclasses.asdict(cfg))

    def log(self, metrics):
        if not self.master:
            return
        self.jsonl.write(json.dumps(metrics) + "\n")
        self.jsonl.flush()
        shown = ["reward", "reward_std", "kl", "loss", "completion_length", "entropy", "grad_norm", "step_time"]
        line = f"step {metrics['step']:5d} | " + " | ".join(f"{k} {metrics[k]:.4g}" for k in shown if k in metrics)
        print(line, flush=True)
        if self.wandb is not None:
            self.wandb.log({wandb_key(k): v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def close(self):
        if self.master:
            self.jsonl.close()
            if self.wandb is not None:
                self.wandb.finish()


def wandb_key(key):
    """Dashboard sections: reward/..., perf/..., train/..."""
    if key.startswith("reward"):
        return key if "/" in key else f"reward/{key}"
    if key in ("step_time", "tokens_per_s", "generation_time"):
        return f"perf/{key}"
    return f"train/{key}"


# ----------------------------------------------------------------------------- the loop


def main(argv):
    cfg = parse_config(argv)
    d = sharding.setup(cfg.device)
    validate(cfg, d.world_size)
    torch.manual_seed(cfg.seed)
    t_start = time.time()

    # models: the policy, and the frozen reference when beta > 0
    model_path = cfg.model
    if cfg.model == model_loading.TINY:
        model_path = model_loading.write_tiny_model(os.path.join(cfg.out_dir, "tiny_model_init"))
    tokenizer = model_loading.load_tokenizer(model_path)
    policy = model_loading.load_model(model_path, cfg.model_init_kwargs, d.device, seed=cfg.seed,
                                      gradient_checkpointing=cfg.gradient_checkpointing)
    policy.train()
    ref = model_loading.build_reference_model(policy, cfg.beta)
    eos_ids = model_loading.eos_token_ids(policy, tokenizer)

    task = rewards.get_task(cfg.task)
    weights = cfg.reward_weights or [1.0] * len(task.reward_funcs)
    if len(weights) != len(task.reward_funcs):
        raise ConfigError("reward_weights", f"{len(weights)} weights for {len(task.reward_funcs)} reward functions "
                          f"({', '.join(f.__name__ for f in task.reward_funcs)})")

    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    total_opt_steps = cfg.max_steps * cfg.num_iterations
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s, total_opt_steps))
    logger = Logger(cfg, d.master)
    G, eps_high = cfg.num_generations, cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    history = []

    for step in range(1, cfg.max_steps + 1):
        t0 = time.time()
        # 1. prompts for this step: a pure function of (seed, step), so a resumed run sees the same ones
        rows = task.make_prompts(random.Random(cfg.seed * 1_000_003 + step), cfg.prompts_per_step)
        prompts = [r["prompt"] for r in rows for _ in range(G)]                     # (N,) grouped by prompt
        fields = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
        tokenizer.truncation_side = "left"
        enc = tokenizer(prompts, return_tensors="pt", padding=True, truncation=True,
                        max_length=cfg.max_prompt_length, add_special_tokens=False).to(d.device)

        # 2. sample G completions per prompt
        n = len(prompts)
        seeds = torch.arange(n, device=d.device) + (cfg.seed * 1_000_003 + step) * n
        policy.eval()
        rollout = grpo.sample(policy, enc.input_ids, enc.attention_mask, max_new_tokens=cfg.max_completion_length,
                              eos_ids=eos_ids, pad_id=tokenizer.pad_token_id, temperature=cfg.temperature,
                              top_k=cfg.top_k, top_p=cfg.top_p, seeds=seeds)
        policy.train()
        t_gen = time.time() - t0
        completions = tokenizer.batch_decode(rollout.completion_ids.masked_fill(rollout.completion_mask == 0,
                                             tokenizer.pad_token_id), skip_special_tokens=True)

        # 3. score, 4. advantages over each whole group
        total, parts = rewards.score_completions(task.reward_funcs, weights, prompts, completions, fields)
        advantages, group_std = grpo.group_advantages(total, G, cfg.scale_rewards)
        advantages = advantages.to(d.device)

        input_ids = torch.cat([enc.input_ids, rollout.completion_ids], dim=1)
        attention_mask = torch.cat([enc.attention_mask, torch.ones_like(rollout.completion_ids)], dim=1)
        T = rollout.completion_ids.shape[1]
        loss_mask = rollout.completion_mask.float()
        if cfg.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.truncated).float()[:, None]
        num_tokens = loss_mask.sum().clamp(min=1)

        # 5. log-probs that stay fixed during the update: the reference's, and the sampling policy's when reused
        micro = [slice(i, i + cfg.micro_batch_size) for i in range(0, n, cfg.micro_batch_size)]

        @torch.no_grad()
        def fixed_logprobs(model):
            return torch.cat([grpo.completion_logprobs(model, input_ids[s], attention_mask[s], T, cfg.temperature)[0]
                              for s in micro])
        ref_logp = fixed_logprobs(ref) if ref is not None else None
        old_logp = fixed_logprobs(policy) if cfg.num_iterations > 1 else None

        # 6. mu optimizer steps on this batch, each accumulating over micro-batches
        for _ in range(cfg.num_iterations):
            sums = {"loss": 0.0, "kl": 0.0, "clip_low": 0.0, "clip_high": 0.0, "entropy": 0.0, "tokens": 0.0}
            for s in micro:
                logp, entropy = grpo.completion_logprobs(policy, input_ids[s], attention_mask[s], T, cfg.temperature)
                old = old_logp[s] if old_logp is not None else logp.detach()  # ratio 1, gradient of A * logp
                loss, m = grpo.grpo_loss(logp, old, ref_logp[s] if ref_logp is not None else None, advantages[s],
                                         loss_mask[s], beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=eps_high,
                                         loss_type=cfg.loss_type, num_sequences=n, num_tokens=num_tokens,
                                         max_completion_length=cfg.max_completion_length)
                loss.backward()
                sums["loss"] += loss.item()
                for k in ("kl", "clip_low", "clip_high"):
                    sums[k] += m[k] * m["tokens"]
                sums["entropy"] += (entropy * loss_mask[s]).sum().item()
                sums["tokens"] += m["tokens"]
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        # 7. log
        step_time = time.time() - t0
        lengths = rollout.completion_mask.sum(1).float()
        valid = total[~torch.isnan(total)]
        tok = max(sums["tokens"], 1.0)
        metrics = {
            "step": step,
            "reward": valid.mean().item() if valid.numel() else float("nan"),
            **{f"reward/{k}": v[~torch.isnan(v)].mean().item() if (~torch.isnan(v)).any() else float("nan")
               for k, v in parts.items()},
            "reward_std": group_std.mean().item(),
            "frac_reward_zero_std": (advantages.view(-1, G).abs().sum(1) == 0).float().mean().item(),
            "loss": sums["loss"], "kl": sums["kl"] / tok, "clip_low": sums["clip_low"] / tok,
            "clip_high": sums["clip_high"] / tok, "entropy": sums["entropy"] / tok,
            "completion_length": lengths.mean().item(), "completion_length_min": lengths.min().item(),
            "completion_length_max": lengths.max().item(),
            "truncated_frac": rollout.truncated.float().mean().item(),
            "grad_norm": grad_norm.item(), "lr": lr, "step_time": step_time, "generation_time": t_gen,
            "tokens_per_s": (attention_mask.sum().item()) / step_time,
        }
        history.append(metrics["reward"])
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            logger.log(metrics)
        if d.master and cfg.print_completions_every and step % cfg.print_completions_every == 0:
            for i in range(0, min(n, 3 * G), G):
                print(f"  [{total[i]:.2f}] {prompts[i][-60:]!r} -> {completions[i][:120]!r}")

    # the trained policy as a Hugging Face folder
    export_dir = os.path.join(cfg.out_dir, "model")
    if d.master:
        model_loading.export_model(policy, tokenizer, export_dir)
        k = max(1, len(history) // 10)
        print(f"done: {cfg.max_steps} steps in {time.time() - t_start:.0f}s | reward first 10% "
              f"{sum(history[:k]) / k:.3f} -> last 10% {sum(history[-k:]) / k:.3f}\n"
              f"metrics: {os.path.join(cfg.out_dir, 'metrics.jsonl')} | model: {export_dir}")
    logger.close()
    sharding.teardown()


if __name__ == "__main__":
    main(sys.argv[1:])
