"""The settings of a run: the `Config` dataclass, each field declared once with what it accepts and whether it
defines the run (cli.setting), the named presets, and the checks that involve several settings.

Nothing heavy is imported here (no torch, transformers or datasets), so that `python train.py --lr=-1` answers
at once; train.py reads the command line into a Config (train.parse_config) and checks it before its imports.
Every field is a command-line setting, --key=value or --key value; `python train.py --help` lists them all.
"""

import math
import os
import typing
from dataclasses import dataclass

from runs import cli
from sandbox import executor  # no heavy imports either: the sandbox's modes are a setting
from runs.cli import ConfigError, setting


def _env(name, default, **kw):  # a Config setting whose default an environment variable may set (wandb's usual ones)
    return setting(factory=lambda: os.environ.get(name, default), **kw)


# What grpo.py and tasks/ accept, repeated here so that the settings are checked before torch is imported
# (both import it); tests/test_startup.py checks that they agree.
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "luspo", "cispo", "sapo", "vespo")
IMPORTANCE_SAMPLING = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# the sampler-trainer mismatch past which the step line warns (verl's rollout-correction docs: |kl| > 0.1,
# chi2_token > 1, effective sample size < 0.3; k3 held to the same 0.1 as the KL)
MISMATCH_WARN = {"log_ratio": 0.1, "k3": 0.1, "chi2_token": 1.0, "ess": 0.3}
MISMATCH_METRICS = ("log_ratio", "k3", "chi2_token", "chi2_seq", "ess", "ppl_ratio")
# the tasks: a file each in tasks/ (tasks.task_names, read here without importing the package)
TASKS = tuple(sorted(f[:-3] for f in os.listdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks"))
                     if f.endswith(".py") and not f.startswith("_")))
# apply_chat_template's own arguments, which the trainer sets (--chat_template_kwargs holds the template's options)
CHAT_TEMPLATE_ARGUMENTS = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                           "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                           "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


@dataclass
class Config:
    # model
    model: str = setting("tiny", run=True)  # local folder or hub id; "tiny" builds a 2-layer byte-level model
    model_init_kwargs: dict = setting(factory=dict, run=False)  # for from_pretrained; no dtype = float32 weights
        # (bf16 compute under torchrun on a GPU); no attn_implementation = sdpa where the model supports it, else eager
    check_model: bool = setting(True, run=False)  # at start, a few tokens through the sampler and the training
        # forward against the model's own forward: an architecture they would get wrong stops the run, named
    gradient_checkpointing: bool = setting(False, run=False)  # recompute each layer in backward: less activation
        # memory, ~1/3 more compute
    device: str = setting("auto", run=False)  # auto (cuda when available), cpu or cuda
    threads: int = setting(0, run=False, at_least=0)  # CPU threads of each process's torch operations; 0 =
        # OMP_NUM_THREADS (torchrun sets 1 for several processes), else the cores shared out among this node's
        # processes. A machine others use too: try 1 (docs/runs.md)
    # task and rewards
    task: str = setting("next_letter", run=True, choices=TASKS)  # where prompts come from and how they are scored:
        # tasks/NAME.py
    reward_funcs: str = setting("", run=True)  # your own reward functions instead of the task's, comma-separated
        # file.py:name or package.module:name (docs/tasks.md)
    reward_weights: list = setting(factory=list, run=True)  # one per reward function, comma-separated; empty =
        # defaults
    sandbox: str = setting("auto", run=False, choices=executor.SANDBOX_MODES)  # model-written code (task code, the
        # python tool): auto or strict = Linux namespaces, refusing where there are none; unsafe = limits only
        # (docs/sandbox.md)
    # batch
    num_generations: int = setting(8, run=True, at_least=2)  # G, completions per prompt
    prompts_per_step: int = setting(16, run=True, at_least=1)  # prompts per optimizer step, over all processes
    dynamic_sampling: bool = setting(False, run=True)  # DAPO: drop groups without a signal (advantages all 0: their
        # rewards all equal) and draw more prompts until prompts_per_step groups have one (docs/objective.md)
    max_generation_rounds: int = setting(4, run=True, at_least=1)  # dynamic_sampling: rounds of prompts_per_step
        # prompts drawn at most; then the step fills up with groups without a signal
    micro_batch_size: int = setting(16, run=False, at_least=1)  # completions per forward/backward (gradient
        # accumulation)
    micro_batch_tokens: int = setting(0, run=False, at_least=0)  # > 0: instead, as many completions per
        # forward/backward as fit this many positions (rows x the longest row's prompt + completion): many short, few
        # long
    num_iterations: int = setting(1, run=True, at_least=1)  # mu: passes over each generated batch
    steps_per_generation: int = setting(1, run=True, at_least=1)  # mini-batches each generated batch is split
        # into, one optimizer step each (a pass makes this many); counted in optimizer steps, not TRL's micro-steps
    # optimisation
    lr: float = setting(1e-3, run=False, above=0)
    lr_schedule: str = setting("constant", run=False, choices=("constant", "linear", "cosine"))  # constant, linear or
        # cosine (to 0 at max_steps, after warmup)
    warmup_steps: int = setting(0, run=False, at_least=0)  # optimizer steps of linear warmup (a step makes
        # num_iterations x steps_per_generation of them)
    weight_decay: float = setting(0.0, run=False, at_least=0)
    adam_beta1: float = setting(0.9, run=False, at_least=0, below=1)
    adam_beta2: float = setting(0.99, run=False, at_least=0, below=1)
    max_grad_norm: float = setting(1.0, run=False, above=0)
    max_bad_steps: int = setting(3, run=False, at_least=1)  # optimizer steps in a row with a non-finite loss or
        # gradient (each one skipped, not applied) before the run stops
    # objective
    beta: float = setting(0.04, run=True, at_least=0)  # KL coefficient; 0 builds no reference model
    sync_ref_model: bool = setting(False, run=True)  # TR-DPO: every ref_model_sync_steps optimizer steps, reference
        # = alpha * policy + (1 - alpha) * reference (needs beta > 0, no LoRA)
    ref_model_mixup_alpha: float = setting(0.6, run=True, at_least=0, at_most=1)  # alpha of sync_ref_model
    ref_model_sync_steps: int = setting(512, run=True, at_least=1)  # optimizer steps between syncs, counted over
        # the run
    epsilon: float = setting(0.2, run=True, above=0, below=1)  # clip range below: ratio >= 1 - epsilon
    epsilon_high: typing.Optional[float] = setting(None, run=True, above=0)  # clip range above (DAPO's clip-higher);
        # None = epsilon
    loss_type: str = setting("grpo", run=True, choices=LOSS_TYPES)  # TRL's names: a policy term and an aggregation
        # (docs/objective.md): grpo, dapo, dr_grpo, bnpo, luspo (PPO clip), cispo, sapo, vespo
    importance_sampling_level: str = setting("token", run=True, choices=IMPORTANCE_SAMPLING_LEVELS)  # the ratio pi /
        # pi_old per token, or per sequence (GSPO)
    delta: typing.Optional[float] = setting(None, run=True, above=1)  # two-sided clip: the unclipped ratio also
        # capped at delta (INTELLECT-2)
    sapo_temperature_pos: float = setting(1.0, run=True, above=0)  # sapo: the gate's temperature where the advantage
        # is > 0
    sapo_temperature_neg: float = setting(1.05, run=True, above=0)  # sapo: ... where it is <= 0
    vespo_k_pos: float = setting(2.0, run=True, at_least=0)  # vespo: the gamma weight's power where the advantage
        # is >= 0 (how fast sequences whose ratio fell below 1 lose weight)
    vespo_lambda_pos: float = setting(3.0, run=True, at_least=0)  # vespo: its decay there (ratios above 1)
    vespo_k_neg: float = setting(3.0, run=True, at_least=0)  # vespo: the power where the advantage is < 0
    vespo_lambda_neg: float = setting(2.0, run=True, at_least=0)  # vespo: the decay there
    top_entropy_quantile: float = setting(1.0, run=True, at_least=0, at_most=1)  # the policy term on the top fraction
        # of tokens by entropy only; 1 = all
    entropy_coef: float = setting(0.0, run=True)  # entropy bonus: minus this times the mean entropy over counted
        # tokens (with use_adaptive_entropy: the coefficient it starts from)
    use_adaptive_entropy: bool = setting(False, run=True)  # Skywork-OR1's control: after each optimizer step the
        # coefficient moves by entropy_coef_delta, up while the mean entropy is at or below entropy_target, else down,
        # and it applies only then (docs/objective.md)
    entropy_target: float = setting(0.2, run=True, at_least=0)  # use_adaptive_entropy: the mean entropy (nats) kept
    entropy_coef_delta: float = setting(0.005, run=True, at_least=0)  # use_adaptive_entropy: the coefficient's step
    entropy_coef_min: float = setting(0.0, run=True, at_least=0)  # use_adaptive_entropy: its bounds
    entropy_coef_max: float = setting(1.0, run=True, at_least=0)
    off_policy_mask_threshold: typing.Optional[float] = setting(None, run=True, at_least=0)
        # drop negative-advantage sequences whose mean log pi_sampler - log pi exceeds this (DeepSeek-V3.2); None =
        # off
    multi_objective_aggregation: str = setting("sum_then_normalize", run=True,
                                               choices=("sum_then_normalize", "normalize_then_sum"))
        # sum_then_normalize: the weighted sum of the rewards normalised within its group; normalize_then_sum: each
        # reward function normalised within its group, then the weighted sum (GDPO)
    soft_punish_cache: int = setting(0, run=True)  # rewards.py:soft_overlong_punishment: the last this many tokens
        # before max_completion_length are punished linearly (DAPO's L_cache)
    scale_rewards: str = setting("group", run=True, choices=("group", "batch", "none"))  # group, batch or none: what
        # the centred reward is divided by
    mask_truncated_completions: bool = setting(False, run=True)  # completions without EOS get no loss (DAPO)
    use_bias_correction_kl: bool = setting(False, run=True)  # the k3 term times the ratio pi / pi_old, as TRL 1.16
        # does by default
    importance_sampling: str = setting("none", run=True, choices=IMPORTANCE_SAMPLING)  # correct for the sampler's
        # log-probs differing from the trainer's: none, token_truncate, token_mask, sequence_truncate or sequence_mask
        # (docs/objective.md)
    importance_sampling_min: float = setting(0.0, run=True, at_least=0)  # weights are clipped to [min, max]
        # (truncate) or zeroed outside (mask)
    importance_sampling_max: float = setting(3.0, run=True)  # (TRL 1.16: vllm_importance_sampling_clip_max, 3.0 by
        # default)
    # sampling
    temperature: float = setting(1.0, run=True, above=0)
    top_p: float = setting(1.0, run=True, above=0, at_most=1)
    top_k: int = setting(0, run=True, at_least=0)  # 0 = off
    max_completion_length: int = setting(4, run=True, at_least=1)
    max_prompt_length: int = setting(512, run=True, at_least=1)  # longer prompts are cut from the left
    generation_batch_size: int = setting(0, run=False, at_least=0)  # completions decoded at once on each process; 0 =
        # all of them. Fewer = a smaller KV cache (long completions); same seeds either way
    rollouts_in_flight: int = setting(0, run=False, at_least=0)  # decode places each process's rows stream through:
        # when a row ends, its place takes the next row waiting (a prefill into that place while the others decode
        # on), so long rows do not leave the batch drained. 0 = batches of generation_batch_size, one after another.
        # The same completions either way (each row draws from its own seed); the KV cache holds this many rows
    max_staleness: int = setting(0, run=True, at_least=0)  # K > 0: while a step's last rows run on, the sampler
        # decodes the prompts of the next K steps, and rows in flight keep their cache across the optimizer step
        # (features/streaming.py; docs/design.md). A step still trains its own prompts; a token is at most K steps
        # older than the weights it trains, and its sampler log-prob is the loss's old log-prob. 0 = each step
        # samples its rows with its own weights
    tp_size: int = setting(1, run=False, at_least=1)  # tensor-parallel decoding: groups of this many processes decode
        # their rows together, each holding 1/tp_size of every layer and of the vocabulary (layers/tensor_parallel.py);
        # it divides the number of processes. Same completions as 1, less memory per process while sampling
    replicas: int = setting(0, run=False, at_least=0)  # HSDP: the processes hold R copies of the model, each sharded
        # over W / R consecutive ranks (FSDP2 on a 2-D mesh): gradients are reduce-scattered within a copy and
        # all-reduced across copies. 1 = one flat mesh over every process; 0 = one copy per node when torchrun formed
        # several nodes and the plan says a node's processes hold the model's shards, else flat
    nodes: int = setting(0, run=False, at_least=0)  # the nodes this run must span: a process whose torchrun formed
        # another number of nodes (a node that rendezvoused on its own) stops at start. 0 = what torchrun formed
    cp_size: int = setting(1, run=False, at_least=1)  # sequence parallelism for long rows: groups of this many
        # processes train their rows together, each computing 1/cp_size of every row's positions through the layers,
        # an all-to-all around each attention (Ulysses; features/sequence_parallel.py). It divides the processes.
        # The same training as 1, with 1/cp_size of the layers' activations per process
    decode_attention_kernel: bool = setting(False, run=False)  # CUDA: decode attention by the split-KV Triton kernel
        # (layers/kernels.py) instead of SDPA; tested against it, speed not yet measured
    compile_layers: bool = setting(False, run=False)  # torch.compile the training forward's decoder layers (meant for
        # GPUs; on the families whose written-out training forward runs, LoRA or not: docs/architectures.md)
    routing_replay: bool = setting(False, run=True)  # MoE models: the training forwards route each token to the
        # experts the sampler chose (gates from the live router; R3, layers/routing.py); metric routing_replay_differ
    chat_template_kwargs: dict = setting(factory=dict, run=True)  # JSON object given to every chat-template
        # rendering (prompts, tools, tool results, reward-model inputs), e.g. '{"enable_thinking": false}'
    shared_prompts: bool = setting(False, run=False)  # each group's prompt computed once: the written-out decoder
        # prefills each distinct prompt once and copies its cache to the group's rows, and the training forwards run a
        # micro-batch's rows with one prompt as one tree, each completion a branch (Qwen3.5's recurrent state forked
        # at the prompt's end), the trees back to back without padding on the written-out layers. The same
        # completions and log-probs up to rounding; vision-language models train padded (docs/performance.md)
    # tools and environments: multi-turn rollouts (environments/__init__.py; docs/agents.md)
    tools: str = setting("", run=True)  # functions the policy may call, comma-separated file.py:name or module:name
    environment: str = setting("", run=True)  # file.py:Class, one instance per rollout; its public methods are tools
    max_turns: int = setting(4, run=True, at_least=1)  # the policy's turns per completion when it has tools (calls
        # between them)
    tool_timeout: float = setting(10.0, run=False, above=0)  # seconds a round of calls may run; a slower call gets an
        # error as result
    # run
    seed: int = setting(0, run=True)
    max_steps: int = setting(300, run=False, at_least=1)
    out_dir: str = setting("out", run=False)  # metrics, config.json, checkpoints and the exported model; one run at a
        # time
    resume: str = setting("auto", run=False, choices=("auto", "force", "never"))  # auto: continue out_dir's run if
        # the settings that define it are unchanged; force: continue even if they changed; never: stop if out_dir
        # holds a run
    log_every: int = setting(1, run=False, at_least=1)
    mismatch_warn: dict = setting(factory=lambda: dict(MISMATCH_WARN), run=False)  # JSON {metric: threshold}: the step
        # line flags, and a note names once, a sampler-trainer mismatch past it (docs/metrics.md): ess below it,
        # |ppl_ratio - 1| above it, any other's magnitude above it; {} = never. The default: verl's warnings (|kl|
        # 0.1, chi2_token 1, ess 0.3)
    print_completions_every: int = setting(50, run=False, at_least=0)  # print a few sampled completions every N
        # steps; 0 = never
    wandb_project: str = _env("WANDB_PROJECT", "grpo", run=False)
    wandb_run_name: typing.Optional[str] = _env("WANDB_NAME", None, run=False)
    wandb_mode: str = _env("WANDB_MODE", "disabled", run=False, choices=("disabled", "offline", "online"))
        # disabled, offline (no account needed) or online
    # several processes and checkpoints (sharding.py)
    mixed_precision: str = setting("auto", run=False, choices=("auto", "bf16", "fp16", "fp32"))  # auto (bf16 compute,
        # fp32 gradient reduction on GPU; fp32 on CPU), bf16, fp16 (the sampler's copies and the training compute in
        # float16, with dynamic loss scaling: fewer sampler-trainer mismatches than bf16), fp32. FSDP2's policy: a
        # single process asking for bf16 or fp16 runs as a world of one. Master weights, gradient reduction and
        # AdamW's state stay float32
    cpu_offload: bool = setting(False, run=False)  # keep the policy's (and reference's) shards, gradients and AdamW
        # states in host memory, copied to the GPU group by group as they are gathered (FSDP2's CPUOffloadPolicy)
    ref_bf16: bool = setting(False, run=True)  # keep the reference's weights in bfloat16 (it never trains): half its
        # memory, its log-probs (and so the KL) rounded as bfloat16 weights give them
    save_every: int = setting(100, run=False, at_least=0)  # checkpoint every N steps and at the last step; 0 = never
    keep_checkpoints: int = setting(2, run=False, at_least=1)  # newest K checkpoints kept in out_dir/checkpoints
    # workloads: data, reward model, evaluation, LoRA, dashboards
    preset: str = setting("", run=False)  # a recipe by name: recipes/NAME.toml's settings, before the command line's
    config: str = setting("", run=False)  # a recipe file (flat TOML of these settings; after --preset's, before the
        # command line's)
    dataset: str = setting("", run=True)  # .jsonl / .parquet file (or hub id) replacing the task's prompt source
    reward_model: str = setting("", run=True)  # sequence-classification model scoring completions ("tiny" builds
        # one); "" = the task's own (tldr: weqweasdas/RM-Gemma-2B), none for the others
    eval_every: int = setting(0, run=False, at_least=0)  # evaluate on held-out prompts every N steps (and at the
        # end); 0 = never
    eval_prompts: int = setting(64, run=False)  # held-out prompts per evaluation (kept out of training when
        # eval_every > 0)
    eval_only: bool = setting(False, run=False)  # no training: evaluate what this command would train from (out_dir's
        # newest checkpoint, else --model, e.g. an exported out/model with a new --out_dir) on the held-out prompts;
        # appends to out_dir/eval.jsonl
    lora_rank: int = setting(0, run=True, at_least=0)  # 0 = train all weights; r > 0 = train rank-r adapters only
    lora_alpha: float = setting(32.0, run=True, above=0)  # adapter output scaled by lora_alpha / lora_rank
    lora_target_modules: str = setting("all", run=True)  # what gets adapters: all = every linear layer in the
        # decoder layers (attention, linear attention, MLP) but MoE routers, and each expert of fused MoE expert
        # weights; or comma-separated names (q_proj, self_attn.q_proj, experts.gate_up_proj; all may be one of them)
    completions_table_every: int = setting(0, run=False, at_least=0)  # wandb table of sampled completions every N
        # steps; 0 = never
    # the memory plan (runs/plan.py)
    plan: bool = setting(False, run=False)  # print what each GPU and host process will hold in loading, generation and
        # training for these settings, from the model's config alone (no weights read), and exit
    plan_world_size: int = setting(0, run=False, at_least=0)  # --plan: the processes (GPUs) to plan for; 0 = WORLD_SIZE
    plan_gpu_memory: float = setting(80.0, run=False, above=0)  # --plan: GiB of memory of each GPU
    plan_gpu_headroom: float = setting(3.0, run=False, at_least=0)  # --plan: GiB of each GPU a plan leaves free for
        # what it does not count: the CUDA context, NCCL's buffers, CUDA graphs' pools, the allocator's fragmentation
    plan_host_memory: float = setting(0.0, run=False, at_least=0)  # --plan: GiB of host memory per node (8 GPUs);
        # 0 = a node's 2 TiB when planning GPUs for other processes than this machine's (--plan_world_size), else
        # this machine's




# The settings that define a run (declared with run=True): resuming in an out_dir whose config.json differs in one
# of them stops (--resume=force goes on anyway). The others (max_steps, logging, checkpoints, micro-batch size, ...)
# may change.
RUN_KEYS = cli.run_keys(Config)

# Recipes: files of settings (flat TOML) in recipes/, applied before the command line's: --preset=NAME for
# recipes/NAME.toml, --config=FILE for any file (README: "Real use").
RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")

# Other trainers' names for settings (TRL's GRPOConfig and transformers' TrainingArguments), with what to use
# here: an unknown key that is one of them says so instead of only "unknown".
OTHER_NAMES = {
    "learning_rate": "use --lr",
    "lr_scheduler_type": "use --lr_schedule (constant, linear or cosine)",
    "warmup_ratio": "use --warmup_steps (optimizer steps)",
    "max_new_tokens": "use --max_completion_length",
    "max_length": "use --max_prompt_length and --max_completion_length",
    "per_device_train_batch_size": "use --prompts_per_step (prompts per optimizer step, over all processes; "
                                   "x --num_generations completions) and --micro_batch_size (completions per "
                                   "forward/backward)",
    "gradient_accumulation_steps": "not needed: a step's --prompts_per_step x --num_generations completions are "
                                   "split into --micro_batch_size ones per forward/backward",
    "num_train_epochs": "use --max_steps",
    "output_dir": "use --out_dir",
    "logging_steps": "use --log_every",
    "save_steps": "use --save_every",
    "save_total_limit": "use --keep_checkpoints",
    "eval_steps": "use --eval_every",
    "report_to": "use --wandb_mode=online (or offline); wandb is the one logger",
    "run_name": "use --wandb_run_name",
    "model_name_or_path": "use --model",
    "torch_dtype": "use --model_init_kwargs='{\"dtype\": \"bfloat16\"}'",
    "dtype": "use --model_init_kwargs='{\"dtype\": \"bfloat16\"}'",
    "bf16": "use --mixed_precision=bf16",
    "use_peft": "use --lora_rank=R (R > 0 trains adapters)",
    "lora_r": "use --lora_rank",
    "use_vllm": "there is no vLLM: the sampler is built in (sampling.py)",
    "vllm_importance_sampling_correction": "use --importance_sampling (token_truncate, sequence_mask, ...)",
    "vllm_importance_sampling_mode": "use --importance_sampling",
    "vllm_importance_sampling_cap": "use --importance_sampling_max",
    "log_completions": "use --print_completions_every (stdout) or --completions_table_every (wandb)",
    "reward_model_name_or_path": "use --reward_model",
    "do_eval": "use --eval_every (or --eval_only to evaluate without training)",
}


def tp_size_problem(tp_size, world_size):
    """What a --tp_size that does not divide the processes needs, said for one process (no group at all) or for
    several (the sizes that would divide them)."""
    if world_size == 1:
        return f"a group of {tp_size} needs torchrun with a multiple of {tp_size} processes; this is one process"
    fits = [t for t in range(1, world_size + 1) if world_size % t == 0]
    return (f"groups of {tp_size} need a multiple of {tp_size} processes, and there are {world_size} "
            f"({', '.join(map(str, fits[:-1]))} or {fits[-1]} divides them)")


def mesh_problems(cfg, world_size, local_size, need):
    """The settings that depend on how torchrun formed the run: `world_size` processes, `local_size` on a node."""
    nodes = max(1, world_size // local_size)
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    need(not cfg.nodes or cfg.nodes == nodes, "nodes",
         f"torchrun formed a run of {nodes} node{'s' * (nodes > 1)} ({world_size} processes, {local_size} on each) at "
         f"{where}, and --nodes={cfg.nodes} asks for {cfg.nodes}: every node's torchrun must name the same "
         f"--rdzv_endpoint, --rdzv_id and --nnodes; refusing to train on a part of the run")
    need(nodes == 1 or (cfg.tp_size <= local_size and local_size % cfg.tp_size == 0), "tp_size",
         f"a group of {cfg.tp_size} would span nodes: a node runs {local_size} processes; a tensor-parallel group "
         f"must lie within one, so at most {local_size}, and a size that divides it")


def validate(cfg, world_size=1, local_size=0):
    """ConfigError naming the first setting that is impossible (alone, or for `world_size` processes; `local_size`
    of them on each node, given where torchrun formed the run)."""
    def need(ok, key, message):
        if not ok:
            raise ConfigError(key, message)
    cli.check(cfg)  # each field's own choices and bounds (its `setting`); below, what depends on several
    need(cfg.prompts_per_step * cfg.num_generations % world_size == 0, "prompts_per_step",
         f"{cfg.prompts_per_step} prompts x {cfg.num_generations} generations do not split evenly over {world_size} processes")
    rows, parts = cfg.prompts_per_step * cfg.num_generations, world_size * cfg.steps_per_generation
    need(rows % parts == 0, "steps_per_generation",
         f"{rows} completions per step do not split into {cfg.steps_per_generation} mini-batches of equal shares on "
         f"each of {world_size} processes (they must divide by {parts})")
    need(not cfg.sync_ref_model or cfg.beta > 0, "sync_ref_model",
         "needs beta > 0 (beta 0 builds no reference model)")
    need(not cfg.sync_ref_model or cfg.lora_rank == 0, "sync_ref_model",
         "needs lora_rank=0 (with LoRA the reference is the policy without its adapters, nothing to sync)")
    need(not cfg.ref_bf16 or (cfg.beta > 0 and cfg.lora_rank == 0), "ref_bf16",
         "needs beta > 0 and lora_rank=0 (otherwise no reference model is built)")
    need(not cfg.cpu_offload or cfg.device != "cpu" or world_size > 1, "cpu_offload",
         "needs torchrun (FSDP2 shards what it offloads); one plain process on the CPU has nothing to offload")
    need(world_size % cfg.tp_size == 0, "tp_size", tp_size_problem(cfg.tp_size, world_size))
    need(world_size % cfg.cp_size == 0, "cp_size", "sequence parallelism: " + tp_size_problem(cfg.cp_size, world_size))
    need(cfg.cp_size == 1 or not cfg.shared_prompts, "cp_size", "cannot take --shared_prompts: a group's rows "
         "packed as a tree have branches that would cross the split of positions")
    need(world_size % max(1, cfg.replicas) == 0, "replicas",
         f"{cfg.replicas} copies of the model do not split the {world_size} processes evenly")
    shards = world_size // max(1, cfg.replicas)
    need(shards % cfg.tp_size == 0, "tp_size", f"a group of {cfg.tp_size} would span two of the {cfg.replicas} "
         f"copies of {shards} processes each (--replicas): a group decodes from one copy's shards")
    if local_size:
        mesh_problems(cfg, world_size, local_size, need)
    # streaming's places: each a row decoding at once, its KV cache allocated whether a row ever takes it or not
    streams = "--rollouts_in_flight" if cfg.rollouts_in_flight else "--max_staleness" if cfg.max_staleness else None
    need(not cfg.generation_batch_size or streams is None, "generation_batch_size",
         f"has no effect with {streams}: a stream's rows decode in its places, not in batches; "
         f"--rollouts_in_flight={cfg.generation_batch_size} bounds the rows decoding at once")
    decoded = rows // world_size * (cfg.max_staleness + 1)  # the rows a process's places can ever hold at once
    need(cfg.rollouts_in_flight <= decoded, "rollouts_in_flight",
         f"{cfg.rollouts_in_flight} places for the {decoded} rows each process decodes at most at once "
         f"({rows // world_size} a step{f' x {cfg.max_staleness + 1} steps' if cfg.max_staleness else ''}): "
         f"the rest would hold KV cache no row uses; at most {decoded}")
    need(not (cfg.max_staleness and cfg.save_every == 1 and cfg.max_steps > 1), "max_staleness",
         "has no effect with --save_every=1: the stream drains at every checkpoint, so no row decodes ahead; "
         "checkpoint less often (--save_every=K > 1) or leave --max_staleness=0")
    need(all(math.isfinite(w) for w in cfg.reward_weights), "reward_weights", f"must be finite, got {cfg.reward_weights}")
    need(0 <= cfg.soft_punish_cache <= cfg.max_completion_length, "soft_punish_cache",
         f"must be in [0, max_completion_length={cfg.max_completion_length}], got {cfg.soft_punish_cache}")
    need(cfg.loss_type != "vespo" or cfg.importance_sampling_level == "token", "importance_sampling_level",
         "vespo makes its own sequence ratio from the token ratios: leave importance_sampling_level=token")
    need(cfg.entropy_coef_max >= cfg.entropy_coef_min, "entropy_coef_max",
         f"must be >= entropy_coef_min ({cfg.entropy_coef_min}), got {cfg.entropy_coef_max}")
    need(not cfg.use_adaptive_entropy or cfg.entropy_coef_min <= cfg.entropy_coef <= cfg.entropy_coef_max,
         "entropy_coef", f"with use_adaptive_entropy, the coefficient it starts from must be in [entropy_coef_min, "
         f"entropy_coef_max] = [{cfg.entropy_coef_min}, {cfg.entropy_coef_max}], got {cfg.entropy_coef}")
    need(cfg.importance_sampling_max > cfg.importance_sampling_min, "importance_sampling_max",
         f"must be > importance_sampling_min ({cfg.importance_sampling_min}), got {cfg.importance_sampling_max}")
    need(cfg.device in ("auto", "cpu", "cuda") or cfg.device.startswith("cuda:"), "device", f"auto, cpu or cuda, got {cfg.device!r}")
    if cfg.device.startswith("cuda"):  # the one check that needs torch
        import torch
        need(torch.cuda.is_available(), "device",
             f"{cfg.device} asked for, but torch {torch.__version__} sees no CUDA GPU here; use --device=cpu or auto")
    need(isinstance(cfg.model_init_kwargs, dict), "model_init_kwargs", "must be a JSON object")
    need(isinstance(cfg.chat_template_kwargs, dict), "chat_template_kwargs", "must be a JSON object")
    need(isinstance(cfg.mismatch_warn, dict) and set(cfg.mismatch_warn) <= set(MISMATCH_METRICS) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in cfg.mismatch_warn.values()), "mismatch_warn",
         f"a JSON object of numbers keyed by {', '.join(MISMATCH_METRICS)}; got {cfg.mismatch_warn!r}")
    taken = sorted(set(cfg.chat_template_kwargs) & set(CHAT_TEMPLATE_ARGUMENTS)) if isinstance(
        cfg.chat_template_kwargs, dict) else []
    need(not taken, "chat_template_kwargs", f"{', '.join(taken)}: set by the trainer itself, not a template option")
    need(cfg.model_init_kwargs.get("device_map") is None, "model_init_kwargs",
         "device_map is not accepted: the trainer places the model (one device per process)")
    need(cfg.eval_prompts >= 1 or (cfg.eval_every == 0 and not cfg.eval_only), "eval_prompts",
         f"must be >= 1 to evaluate, got {cfg.eval_prompts}")
