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
import sys
import time
import typing
import uuid
from dataclasses import dataclass, field

import torch
import transformers

import grpo
import model_loading
import rewards
import sharding
import tasks


@dataclass
class Config:
    # model
    model: str = "tiny"                   # local folder or hub id; "tiny" builds a 2-layer byte-level model
    model_init_kwargs: dict = field(default_factory=lambda: {"attn_implementation": "sdpa"})  # no dtype: bf16 on CUDA, fp32 on CPU
    gradient_checkpointing: bool = False  # recompute each layer in backward: less activation memory, ~1/3 more compute
    device: str = "auto"                  # auto (cuda when available), cpu or cuda
    # task and rewards
    task: str = "next_letter"             # where prompts come from and how they are scored (tasks.get_task)
    reward_weights: list = field(default_factory=list)  # one per reward function, comma-separated; empty = all 1
    # batch
    num_generations: int = 8              # G, completions per prompt
    prompts_per_step: int = 16            # prompts per optimizer step, over all processes
    micro_batch_size: int = 16            # completions per forward/backward (gradient accumulation)
    micro_batch_workers: int = 0          # CPU, one process: micro-batches computed this many at a time, on threads;
                                          # 0 = 2 where that helps and is safe (sharding.MicroBatchWorkers), 1 = one at a time
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
    # several processes and checkpoints (sharding.py)
    mixed_precision: str = "auto"         # auto (bf16 compute, fp32 gradient reduction on GPU; fp32 on CPU), bf16, fp32
    save_every: int = 100                 # checkpoint every N steps and at the last step; 0 = never
    keep_checkpoints: int = 2             # newest K checkpoints kept in out_dir/checkpoints
    # workloads: data, reward model, evaluation, LoRA, dashboards
    preset: str = ""                      # a named set of overrides from PRESETS, applied before the other --key=value
    dataset: str = ""                     # .jsonl / .parquet file (or hub id) replacing the task's prompt source
    reward_model: str = ""                # sequence-classification model scoring completions ("tiny" builds one);
                                          # "" = the task's own (tldr: weqweasdas/RM-Gemma-2B), none for the others
    eval_every: int = 0                   # evaluate on held-out prompts every N steps (and at the end); 0 = never
    eval_prompts: int = 64                # held-out prompts per evaluation (kept out of training when eval_every > 0)
    lora_rank: int = 0                    # 0 = train all weights; r > 0 = train rank-r adapters only
    lora_alpha: float = 32.0              # adapter output scaled by lora_alpha / lora_rank
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # linear layers to adapt
    completions_table_every: int = 0      # wandb table of sampled completions every N steps; 0 = never


# Named runs: Config overrides applied before the command line's (README: "Tasks, presets, LoRA and evaluation").
_QWEN_SDPA = {"attn_implementation": "sdpa"}  # no dtype: float32 weights, bf16 compute under torchrun
PRESETS = {
    "gsm8k-qwen2.5-0.5b": dict(
        model="Qwen/Qwen2.5-0.5B-Instruct", model_init_kwargs=_QWEN_SDPA, task="gsm8k",
        num_generations=8, prompts_per_step=32, micro_batch_size=16, lr=1e-6, warmup_steps=10, beta=0.04,
        temperature=1.0, max_completion_length=512, max_prompt_length=512, max_steps=400,
        eval_every=50, eval_prompts=256, completions_table_every=25, print_completions_every=25),
    "countdown-qwen2.5-3b": dict(
        model="Qwen/Qwen2.5-3B-Instruct", model_init_kwargs=_QWEN_SDPA, task="countdown",
        num_generations=8, prompts_per_step=32, micro_batch_size=8, lr=1e-6, warmup_steps=10, beta=0.001,
        temperature=1.0, max_completion_length=1024, max_prompt_length=256, max_steps=300,
        eval_every=50, eval_prompts=256, completions_table_every=25, print_completions_every=25),
    "tldr-qwen2-0.5b": dict(
        model="Qwen/Qwen2-0.5B-Instruct", model_init_kwargs=_QWEN_SDPA, task="tldr",
        reward_model="weqweasdas/RM-Gemma-2B", num_generations=8, prompts_per_step=16, micro_batch_size=16,
        lr=1e-6, beta=0.04, temperature=1.0, max_completion_length=128, max_prompt_length=512, max_steps=500,
        eval_every=100, eval_prompts=128, completions_table_every=25, print_completions_every=25),
}
# the same run training rank-32 adapters only: a higher learning rate, as usual for LoRA
PRESETS["gsm8k-qwen2.5-0.5b-lora"] = {**PRESETS["gsm8k-qwen2.5-0.5b"], "lr": 2e-5, "lora_rank": 32, "lora_alpha": 64.0}


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
        if typ is float:
            number = float(value)
            if not math.isfinite(number):  # inf or nan would pass every range check below
                raise ValueError
            return number
        if typ in (int, str):
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
    presets = [a.split("=", 1)[1] for a in argv if a.startswith("--preset=")]
    for name in presets[-1:]:  # a preset's values first, so that every other --key=value wins over it
        if name not in PRESETS:
            raise ConfigError("preset", f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
        for key, value in PRESETS[name].items():
            setattr(cfg, key, dict(value) if isinstance(value, dict) else value)
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
    need(cfg.micro_batch_workers >= 0, "micro_batch_workers", f"must be >= 0, got {cfg.micro_batch_workers}")
    need(cfg.micro_batch_workers <= 1 or world_size == 1, "micro_batch_workers",
         f"threads share micro-batches within one process only; under {world_size} processes set 0 or 1")
    need(cfg.num_iterations >= 1, "num_iterations", f"must be >= 1, got {cfg.num_iterations}")
    need(cfg.lr > 0, "lr", f"must be > 0, got {cfg.lr}")
    need(cfg.lr_schedule in ("constant", "linear", "cosine"), "lr_schedule", f"constant, linear or cosine, got {cfg.lr_schedule!r}")
    need(cfg.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {cfg.warmup_steps}")
    need(cfg.beta >= 0, "beta", f"must be >= 0, got {cfg.beta}")
    need(cfg.max_grad_norm > 0, "max_grad_norm", f"must be > 0, got {cfg.max_grad_norm}")
    need(0 <= cfg.adam_beta1 < 1, "adam_beta1", f"must be in [0, 1), got {cfg.adam_beta1}")
    need(0 <= cfg.adam_beta2 < 1, "adam_beta2", f"must be in [0, 1), got {cfg.adam_beta2}")
    need(cfg.weight_decay >= 0, "weight_decay", f"must be >= 0, got {cfg.weight_decay}")
    need(all(math.isfinite(w) for w in cfg.reward_weights), "reward_weights", f"must be finite, got {cfg.reward_weights}")
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
    need(cfg.mixed_precision in ("auto", "bf16", "fp32"), "mixed_precision", f"auto, bf16 or fp32, got {cfg.mixed_precision!r}")
    need(cfg.save_every >= 0, "save_every", f"must be >= 0, got {cfg.save_every}")
    need(cfg.keep_checkpoints >= 1, "keep_checkpoints", f"must be >= 1, got {cfg.keep_checkpoints}")
    need(cfg.wandb_mode in ("disabled", "offline", "online"), "wandb_mode", f"disabled, offline or online, got {cfg.wandb_mode!r}")
    need(cfg.device in ("auto", "cpu", "cuda") or cfg.device.startswith("cuda:"), "device", f"auto, cpu or cuda, got {cfg.device!r}")
    need(isinstance(cfg.model_init_kwargs, dict), "model_init_kwargs", "must be a JSON object")
    need(cfg.model_init_kwargs.get("device_map") is None, "model_init_kwargs",
         "device_map is not accepted: the trainer places the model (one device per process)")
    need(cfg.task in tasks.TASKS, "task", f"one of {', '.join(tasks.TASKS)}, got {cfg.task!r}")
    need(cfg.eval_every >= 0, "eval_every", f"must be >= 0, got {cfg.eval_every}")
    need(cfg.eval_prompts >= 1 or cfg.eval_every == 0, "eval_prompts", f"must be >= 1 to evaluate, got {cfg.eval_prompts}")
    need(cfg.lora_rank >= 0, "lora_rank", f"must be >= 0, got {cfg.lora_rank}")
    need(cfg.lora_alpha > 0, "lora_alpha", f"must be > 0, got {cfg.lora_alpha}")
    need(cfg.completions_table_every >= 0, "completions_table_every", f"must be >= 0, got {cfg.completions_table_every}")


def make_optimizer(params, cfg):
    """AdamW over the tensors `params`; fused (one update call over all parameters) on devices torch has the
    kernel for, as in Hugging Face Trainer's default `adamw_torch_fused`, and torch's default implementation
    elsewhere. On CPU the default is a loop over tensors, about 5x slower per step for the tiny model (1.34
    against 0.28 ms). A checkpoint's optimizer state brings its own setting: one saved unfused resumes unfused."""
    params = list(params)
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             weight_decay=cfg.weight_decay, fused=fused or None)


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


def _step_of(line):
    """The step of a metrics.jsonl line; None for a line cut short when a run was killed mid-write."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


class Logger:
    """stdout line, out_dir/metrics.jsonl, and wandb when asked for; only the master process writes."""

    def __init__(self, cfg, master, resume_step=0, run_id=None):
        self.master, self.wandb = master, None
        if not master:
            return
        os.makedirs(cfg.out_dir, exist_ok=True)
        path = os.path.join(cfg.out_dir, "metrics.jsonl")
        # steps after the checkpoint we resume from are about to be redone: drop their lines
        kept = []
        if os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if _step_of(line) is not None and _step_of(line) <= resume_step]
        with open(path, "w") as f:
            f.writelines(kept)
        self.jsonl = open(path, "a")
        if cfg.wandb_mode != "disabled":
            import wandb
            # mode offline needs no account; online without credentials fails here instead of prompting.
            # A resumed run continues the same wandb run (its id is saved in the checkpoint).
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, mode=cfg.wandb_mode,
                                    dir=cfg.out_dir, config=dataclasses.asdict(cfg), id=run_id, resume="allow")

    def log(self, metrics):
        if not self.master:
            return
        self.jsonl.write(json.dumps(metrics) + "\n")
        self.jsonl.flush()
        shown = ["reward", "reward_std", "kl", "loss", "completion_length", "entropy", "grad_norm", "step_time",
                 "eval/reward", "eval/accuracy_greedy", "eval/accuracy"]
        line = f"step {metrics['step']:5d} | " + " | ".join(f"{k} {metrics[k]:.4g}" for k in shown if k in metrics)
        print(line, flush=True)
        if self.wandb is not None:
            self.wandb.log({wandb_key(k): v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def table(self, step, name, columns):
        """A wandb.Table from {column: values} (no-op without wandb); log it before the step's metrics."""
        if self.wandb is None:
            return
        import wandb
        self.wandb.log({name: wandb.Table(columns=list(columns), data=[list(r) for r in zip(*columns.values())])},
                       step=step)

    def close(self):
        if self.master:
            self.jsonl.close()
            if self.wandb is not None:
                self.wandb.finish()


def wandb_key(key):
    """Dashboard sections: reward/..., perf/..., eval/..., train/..."""
    if key.startswith(("eval/", "train/", "perf/")):
        return key
    if key.startswith("reward"):
        return key if "/" in key else f"reward/{key}"
    if key in ("step_time", "tokens_per_s", "generation_time"):
        return f"perf/{key}"
    return f"train/{key}"


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def encode_prompts(tokenizer, prompts, cfg, device):
    """Left-padded prompt ids and mask; prompts longer than max_prompt_length keep their end."""
    return tokenizer(prompts, return_tensors="pt", padding=True, truncation=True, max_length=cfg.max_prompt_length,
                     add_special_tokens=False).to(device)


def generate(policy, tokenizer, prompt_ids, prompt_mask, seeds, temperature, cfg, d, eos_ids):
    """Sample one completion per row on the gathered weights; return the rollout and the completions' text."""
    with sharding.gathered(policy):  # full weights once for the whole decode loop
        rollout = policy(grpo.sample, prompt_ids, prompt_mask, max_new_tokens=cfg.max_completion_length,
                         eos_ids=eos_ids, pad_id=tokenizer.pad_token_id, temperature=temperature, top_k=cfg.top_k,
                         top_p=cfg.top_p, seeds=seeds, all_done=sharding.all_done_fn(d))
    text = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)  # padded after the first EOS
    return rollout, text


def evaluate(policy, tokenizer, task, weights, cfg, d, eos_ids):
    """Held-out prompts: greedy accuracy and reward (one completion each), then the mean over G samples each.

    The rows are split over the processes (the last rank's share padded with
    copies of the last row, dropped again), and the scores gathered: every rank
    samples the same number of rows, so all of them make the same collectives.
    """
    device = d.device
    rows = task.eval_rows
    if not rows:
        return {}
    was_training = policy.training
    policy.eval()
    results = {}
    for label, G, temperature in (("greedy", 1, 0.0), ("sampled", cfg.num_generations, cfg.temperature)):
        totals, correct = [], []
        comp = {}
        for start in range(0, len(rows), cfg.prompts_per_step):
            chunk = rows[start:start + cfg.prompts_per_step]
            count = len(chunk) * G
            per_rank = -(-count // d.world_size)
            # row i is prompt i // G; the padding rows copy the last row, seed included, so they sample alike
            index = list(range(count)) + [count - 1] * (per_rank * d.world_size - count)
            prompts = [chunk[i // G]["prompt"] for i in index]
            enc = encode_prompts(tokenizer, prompts, cfg, device)  # all rows: the same padding on every rank
            mine = slice(d.rank * per_rank, (d.rank + 1) * per_rank)
            fields = {k: [chunk[i // G][k] for i in index[mine]] for k in chunk[0] if k != "prompt"}
            # the same seeds at every evaluation: successive evaluations differ by the policy, not by luck
            seeds = torch.tensor(index[mine], device=device) + start * G + (cfg.seed + 7) * 1_000_003
            rollout, completions = generate(policy, tokenizer, enc.input_ids[mine], enc.attention_mask[mine], seeds,
                                            temperature, cfg, d, eos_ids)
            total, parts = rewards.score_completions(task.reward_funcs, weights, prompts[mine], completions, fields)
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
    policy.train(was_training)
    return results


# ----------------------------------------------------------------------------- the loop


def main(argv):
    cfg = parse_config(argv)
    d = sharding.setup(cfg.device)
    validate(cfg, d.world_size)
    torch.manual_seed(cfg.seed)
    t_start = time.time()
    transformers.utils.logging.disable_progress_bar()

    # models: the policy, and the frozen reference when beta > 0
    model_path = cfg.model
    if cfg.model == model_loading.TINY:
        model_path = os.path.join(cfg.out_dir, "tiny_model_init")
        if d.master:
            model_loading.write_tiny_model(model_path)
        sharding.barrier(d)  # the others read it once written
    tokenizer = model_loading.load_tokenizer(model_path)
    # several processes: load on the CPU, fully_shard moves each process's shard to its device
    load_device = "cpu" if d.world_size > 1 else d.device
    policy = model_loading.load_model(model_path, cfg.model_init_kwargs, load_device, seed=cfg.seed,
                                      gradient_checkpointing=cfg.gradient_checkpointing)
    if cfg.lora_rank:  # adapters only; the reference is then the policy with them switched off
        model_loading.add_lora(policy, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
    ref = model_loading.build_reference_model(policy, 0 if cfg.lora_rank else cfg.beta)
    eos_ids = model_loading.eos_token_ids(policy, tokenizer)
    low = {p.dtype for p in policy.parameters() if p.requires_grad} & {torch.bfloat16, torch.float16}
    if low and cfg.lr < 1e-4 and d.master:
        print(f"warning: training {low.pop()} weights at lr={cfg.lr:g}: most AdamW updates are smaller than the "
              f"weights' rounding step and are lost; load float32 weights (no dtype in model_init_kwargs) and let "
              f"torchrun + FSDP2 compute in bfloat16", flush=True)
    # both wrapped so that every call into them is one forward of the FSDP root (see sharding.Root)
    policy = sharding.shard(sharding.Root(policy), d, cfg.mixed_precision)
    policy.train()
    if ref is not None:
        ref = sharding.shard(sharding.Root(ref), d, cfg.mixed_precision).eval()
        sharding.check_same_placement(policy, ref)

    # task: prompts, reward functions (plus a reward model's score), held-out evaluation prompts
    rm_path = cfg.reward_model or tasks.TASK_REWARD_MODELS.get(cfg.task, "")
    if rm_path == model_loading.TINY:
        rm_path = os.path.join(cfg.out_dir, "tiny_reward_model_init")
        if d.master:
            model_loading.write_tiny_reward_model(rm_path)
        sharding.barrier(d)
    reward_model = None  # (model behind its root wrapper, its own tokenizer)
    if rm_path:
        rm, rm_tokenizer = model_loading.load_reward_model(rm_path, cfg.model_init_kwargs, load_device, cfg.seed + 1)
        # sharded like the reference; every rank scores as many completions in as many forwards
        reward_model = (sharding.shard(sharding.Root(rm), d, cfg.mixed_precision).eval(), rm_tokenizer)
    try:
        task = tasks.get_task(cfg.task, tokenizer=tokenizer, dataset=cfg.dataset, seed=cfg.seed,
                                eval_prompts=cfg.eval_prompts if cfg.eval_every else 0, reward_model=reward_model)
    except (ValueError, OSError) as e:
        raise SystemExit(f"task {cfg.task}: {e}") from e
    weights = cfg.reward_weights or task.weights or [1.0] * len(task.reward_funcs)
    if len(weights) != len(task.reward_funcs):
        raise ConfigError("reward_weights", f"{len(weights)} weights for {len(task.reward_funcs)} reward functions "
                          f"({', '.join(f.__name__ for f in task.reward_funcs)})")

    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable, cfg)
    try:
        workers = sharding.MicroBatchWorkers(sharding.MicroBatchWorkers.count(cfg.micro_batch_workers, d, policy.lm))
    except ValueError as e:
        raise ConfigError("micro_batch_workers", f"{e}; set 0 or 1") from e
    total_opt_steps = cfg.max_steps * cfg.num_iterations
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s, total_opt_steps))

    # resume from the newest complete checkpoint in out_dir, if any
    start_step, run_id = 0, None
    resumed = sharding.load_latest_checkpoint(cfg.out_dir, policy, optimizer, d)
    if resumed is not None:
        scheduler.load_state_dict(resumed["scheduler"])
        start_step, run_id = resumed["step"], resumed["wandb_id"]
        if d.master:
            print(f"resuming from {resumed['path']} (step {start_step}, saved by {resumed['world_size']} "
                  f"process(es), now {d.world_size})", flush=True)
    run_id = run_id or uuid.uuid4().hex[:12]  # os.urandom: leaves the seeded generators alone
    logger = Logger(cfg, d.master, resume_step=start_step, run_id=run_id)
    G, eps_high = cfg.num_generations, cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    history = []

    for step in range(start_step + 1, cfg.max_steps + 1):
        t0 = time.time()
        # 1. prompts for this step: a pure function of (seed, step), so a resumed run sees the same ones.
        # Tokenized all together (the same padding on every rank), then each rank takes its slice of rows.
        rows = task.prompts_for_step(cfg.seed, step, cfg.prompts_per_step)
        all_prompts = [r["prompt"] for r in rows for _ in range(G)]                 # (N,) grouped by prompt
        enc = encode_prompts(tokenizer, all_prompts, cfg, d.device)
        N = len(all_prompts)
        n = N // d.world_size                                                       # rows on this rank
        mine = slice(d.rank * n, (d.rank + 1) * n)
        prompts = all_prompts[mine]
        fields = {k: [r[k] for r in rows for _ in range(G)][mine] for k in rows[0] if k != "prompt"}
        prompt_ids, prompt_mask = enc.input_ids[mine], enc.attention_mask[mine]

        # 2. sample G completions per prompt; row seeds are global row indices, so any world size samples alike
        seeds = (torch.arange(N, device=d.device) + (cfg.seed * 1_000_003 + step) * N)[mine]
        policy.eval()
        rollout, completions = generate(policy, tokenizer, prompt_ids, prompt_mask, seeds, cfg.temperature, cfg, d,
                                        eos_ids)
        policy.train()
        t_gen = time.time() - t0

        # 3. score this rank's completions, 4. advantages over each whole group: all rewards, then our rows
        total, parts = rewards.score_completions(task.reward_funcs, weights, prompts, completions, fields)
        if reward_model is not None:
            sharding.free_gathered(reward_model[0])  # forward only: nothing else frees its gathered root weights
        all_total = sharding.all_gather_rows(total, d)                             # (N,)
        all_advantages, group_std = grpo.group_advantages(all_total, G, cfg.scale_rewards)
        advantages = all_advantages[mine].to(d.device)

        input_ids = torch.cat([prompt_ids, rollout.completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, torch.ones_like(rollout.completion_ids)], dim=1)
        T = rollout.completion_ids.shape[1]
        loss_mask = rollout.completion_mask.float()
        if cfg.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.truncated).float()[:, None]
        # normalisers over the whole batch on all ranks, so any world size gives the same gradient
        num_tokens = torch.tensor(sharding.all_reduce_sum([loss_mask.sum().item()], d)[0], device=d.device).clamp(min=1)

        # 5. log-probs that stay fixed during the update: the reference's, and the sampling policy's when reused
        # rows of similar length together, each micro-batch cut to the columns its rows use
        micro = grpo.micro_batches(attention_mask, loss_mask, T, cfg.micro_batch_size)

        def fixed_logprobs(model):  # one (m, t) tensor per micro-batch
            @torch.no_grad()  # inside: a worker thread has its own grad mode
            def one(mb):
                return model(grpo.completion_logprobs, *mb.take(input_ids, attention_mask), mb.t, cfg.temperature)[0]
            logp = list(workers.map(one, micro))
            if model is ref:
                sharding.free_gathered(ref)  # never backward: nothing else would free the root's gathered weights
            return logp
        ref_logp = None
        if cfg.beta > 0:
            with model_loading.adapters_disabled(policy):  # LoRA: the reference is the policy minus its adapters
                ref_logp = fixed_logprobs(ref if ref is not None else policy)
        old_logp = fixed_logprobs(policy) if cfg.num_iterations > 1 else None

        # 6. mu optimizer steps on this batch, each accumulating over micro-batches
        def micro_step(i):  # forward, loss and backward of micro-batch i
            mb = micro[i]
            logp, entropy = policy(grpo.completion_logprobs, *mb.take(input_ids, attention_mask), mb.t,
                                   cfg.temperature)
            old = old_logp[i] if old_logp is not None else logp.detach()  # ratio 1, gradient of A * logp
            mb_mask = loss_mask[mb.rows, :mb.t]
            loss, m = grpo.grpo_loss(logp, old, ref_logp[i] if ref_logp is not None else None, advantages[mb.rows],
                                     mb_mask, beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=eps_high,
                                     loss_type=cfg.loss_type, num_sequences=N, num_tokens=num_tokens,
                                     max_completion_length=cfg.max_completion_length)
            # this rank's loss is its share of a sum over all ranks; FSDP averages gradients over ranks
            grads = workers.backward(loss * d.world_size, trainable)
            return loss.detach(), m, (entropy * mb_mask).sum(), grads

        for _ in range(cfg.num_iterations):
            sums = {"loss": 0.0, "kl": 0.0, "clip_low": 0.0, "clip_high": 0.0, "entropy": 0.0, "tokens": 0.0}
            for loss, m, entropy_sum, grads in workers.map(micro_step, range(len(micro))):
                workers.accumulate(trainable, grads)
                del grads  # added: held no longer than it has to be
                # summed on the device: no wait for it until the step's metrics are read
                sums["loss"] += loss
                for k in ("kl", "clip_low", "clip_high"):
                    sums[k] += m[k] * m["tokens"]
                sums["entropy"] += entropy_sum
                sums["tokens"] += m["tokens"]
            grad_norm = sharding.full_tensor(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm))
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        # 7. log, with every metric over all ranks
        step_time = time.time() - t0
        keys = ["loss", "kl", "clip_low", "clip_high", "entropy", "tokens"]
        local = torch.stack([torch.as_tensor(sums[k], dtype=torch.float32, device=d.device) for k in keys]).tolist()
        totals = sharding.all_reduce_sum(local + [attention_mask.sum().item()], d)
        sums = dict(zip(keys + ["seen"], totals))
        lengths = sharding.all_gather_rows(rollout.completion_mask.sum(1).float(), d)
        truncated = sharding.all_gather_rows(rollout.truncated.float(), d)
        parts = {k: sharding.all_gather_rows(v, d) for k, v in parts.items()}
        valid = all_total[~torch.isnan(all_total)]
        tok = max(sums["tokens"], 1.0)
        metrics = {
            "step": step,
            "reward": valid.mean().item() if valid.numel() else float("nan"),
            **{f"reward/{k}": v[~torch.isnan(v)].mean().item() if (~torch.isnan(v)).any() else float("nan")
               for k, v in parts.items()},
            "reward_std": group_std.mean().item(),
            "frac_reward_zero_std": (all_advantages.view(-1, G).abs().sum(1) == 0).float().mean().item(),
            "loss": sums["loss"], "kl": sums["kl"] / tok, "clip_low": sums["clip_low"] / tok,
            "clip_high": sums["clip_high"] / tok, "entropy": sums["entropy"] / tok,
            "completion_length": lengths.mean().item(), "completion_length_min": lengths.min().item(),
            "completion_length_max": lengths.max().item(),
            "truncated_frac": truncated.mean().item(),
            "grad_norm": grad_norm.item(), "lr": lr, "step_time": step_time, "generation_time": t_gen,
            "tokens_per_s": sums["seen"] / step_time,
        }
        history.append(metrics["reward"])
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps):
            metrics.update(evaluate(policy, tokenizer, task, weights, cfg, d, eos_ids))
            if reward_model is not None:
                sharding.free_gathered(reward_model[0])
        if cfg.completions_table_every and step % cfg.completions_table_every == 0:
            shown = slice(0, min(n, 4 * G))  # the first four groups, whole
            logger.table(step, "completions", {
                "prompt": prompts[shown], "completion": completions[shown],
                **{k: v[shown].tolist() for k, v in parts.items()},
                "reward": total[shown].tolist(), "advantage": advantages[shown].tolist()})
        if step % cfg.log_every == 0 or step == cfg.max_steps or "eval/reward" in metrics:
            logger.log(metrics)
        if d.master and cfg.print_completions_every and step % cfg.print_completions_every == 0:
            for i in range(0, min(n, 3 * G), G):
                print(f"  [{total[i]:.2f}] {prompts[i][-60:]!r} -> {completions[i][:120]!r}")
        # 8. checkpoint (every rank writes its shard)
        if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.max_steps):
            trainer_state = {"scheduler": scheduler.state_dict(), "wandb_id": run_id,
                             "data": {"seed": cfg.seed, "next_step": step + 1}}  # prompts are f(seed, step)
            sharding.save_checkpoint(cfg.out_dir, step, policy, optimizer, trainer_state, d, keep=cfg.keep_checkpoints)

    # the trained policy as one Hugging Face folder with full tensors
    export_dir = os.path.join(cfg.out_dir, "model")
    full_weights = sharding.full_state_dict(policy)  # a collective: every rank takes part
    if d.master:
        model_loading.export_model(policy.lm, tokenizer, export_dir, state_dict=full_weights)
        if history:  # the steps this call ran (a resumed run: those after the checkpoint)
            k = max(1, len(history) // 10)
            print(f"done: steps {start_step + 1}-{cfg.max_steps} in {time.time() - t_start:.0f}s | reward first 10% "
                  f"{sum(history[:k]) / k:.3f} -> last 10% {sum(history[-k:]) / k:.3f}")
        else:
            print(f"done: {cfg.out_dir} already holds step {start_step} of {cfg.max_steps}; no step left to run")
        print(f"metrics: {os.path.join(cfg.out_dir, 'metrics.jsonl')} | model: {export_dir}")
    logger.close()
    sharding.teardown()


if __name__ == "__main__":
    main(sys.argv[1:])
