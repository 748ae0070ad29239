"""What a run is built from: the models, the task, the tools, the optimizer and the checks made before the first
step (train.py's `setup`, run once; the step and the loop are in train.py).

Models load the deferred way (model_loading.py) on the CPU when several processes will shard them, else on the
run's device; the tiny models are written to out_dir by rank 0 and read by every rank.
"""

import dataclasses
import functools
import os
import time
import typing
from dataclasses import dataclass, field

import huggingface_hub
import torch
import transformers

import environments
import model_loading
import rewards
import sampling
import sharding
import tasks
from environments import responses
from layers import hf_decoder, lora, routing, tensor_parallel, transformer, vision
from sandbox import executor
from config import Config, ConfigError


def make_optimizer(params, cfg):
    """AdamW over the tensors `params`; fused (one update call over all parameters) on devices torch has the
    kernel for, as in Hugging Face Trainer's default `adamw_torch_fused`, and torch's default implementation
    elsewhere. On CPU the default is a loop over tensors, about 5x slower per step for the tiny model (1.34
    against 0.28 ms). A checkpoint's optimizer state brings its own setting: one saved unfused resumes unfused."""
    params = list(params)
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             weight_decay=cfg.weight_decay, fused=fused or None)


@dataclass
class Run:
    """What setup() builds once and every step uses."""
    cfg: Config
    d: sharding.Dist
    tokenizer: object
    policy: sharding.Root               # the language model behind its (sharded) root wrapper
    ref: typing.Optional[sharding.Root]  # the reference (frozen unless sync_ref_model); None when beta == 0 or LoRA
    eos_ids: list
    task: tasks.Task
    weights: list                       # one per reward function
    reward_model: object                # (root-wrapped model, its tokenizer) or None
    optimizer: torch.optim.Optimizer
    agent: typing.Optional[environments.Agent] = None  # tools / environment of multi-turn rollouts, or None
    bad_steps: int = 0                  # optimizer steps in a row skipped for a non-finite loss or gradient
    entropy_coef: float = 0.0           # the entropy bonus's coefficient, which use_adaptive_entropy moves
    last_entropy: typing.Optional[float] = None  # the last optimizer step's mean entropy (adaptive control)
    images: typing.Optional[object] = None  # vision.ImageEncoder of a vision-language policy's prompts, or None
    paths: str = ""                     # which way the sampler and the training forward run the policy (the banner's)
    loss_scale: typing.Optional[sharding.LossScale] = None  # float16 compute's dynamic loss scale (else None)
    # The seams where optional features plug into the step (train.setup sets the core's own functions, then
    # features/apply.py applies the run's features to them, in order):
    rollout: typing.Callable = None     # (run, step, round) -> this rank's rows sampled (rollouts.Batch)
    rows_of: typing.Callable = None     # sampling.rows_of's signature -> this rank's rows of a step's prompts
    draw: typing.Callable = None        # (run, step) -> the step's scored batch (train.draw)
    rewards: typing.Callable = None     # (run, batch, step, seconds) -> the batch's rewards (train.rewards_of)
    micro_batches: typing.Callable = None  # (run, batch, rows, mask, loss_mask, T) -> a mini-batch's micro-batches
    reference: object = None            # runs the reference's forward: `ref` itself, unless a feature says otherwise
    forward: object = None              # the training forward (logprobs.Forward), which features wrap
    sample_options: dict = field(default_factory=dict)  # keywords of sampling.sample_rows a feature adds
    forward_extras: list = field(default_factory=list)  # (run, batch) -> (micro-batch -> forward keywords)
    step_metrics: list = field(default_factory=list)    # (run, batch, step, metrics so far) -> a feature's metrics
    # the update's (train.update): what a mini-batch's loss is, which tokens count, and what each optimizer step does
    objective: typing.Callable = None   # (run) -> the loss's settings (grpo.Objective) for the next optimizer step
    entropy_grad: bool = False          # whether the training forward carries the entropy's gradient (a bonus)
    old_logprobs: typing.Callable = None  # (cfg, minis, loss_mask, rollout, step, device) -> train.OldLogprobs
    select_tokens: typing.Callable = None  # (run, batch, inputs, minis, entropies) -> (j, i, mb, logp, entropy) -> keep
    backward: typing.Callable = None    # (loss) -> its backward (torch.Tensor.backward; float16 scales the loss)
    optimizer_step: typing.Callable = None  # (run, opt_step, step loss) -> (grad norm, lr, taken); float16 wraps it
    after_optimizer_step: list = field(default_factory=list)  # (run, opt_step, entropy sum, tokens) after each one
    update_metrics: list = field(default_factory=list)  # (the update's sums over every rank) -> a feature's metrics
    stream: object = None               # features/streaming.py's RolloutStream, with --max_staleness
    ref_routing: list = field(default_factory=lambda: [0.0, 0.0])  # routing replay: the reference's (differ, decisions)


def setup(cfg, d):
    """Models, task and optimizer for one run; nothing is read from or written to out_dir but the tiny models."""
    torch.manual_seed(cfg.seed)
    # transformers' bars for loading and saving off; the hub's download bars on, so a long download shows progress
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.enable_progress_bars()
    try:  # first: a spec that does not resolve stops the run before any model loads
        own_rewards = tasks.load_reward_funcs(cfg.reward_funcs) if cfg.reward_funcs else None
    except ValueError as e:
        raise ConfigError("reward_funcs", e) from e
    check_sandbox(cfg, d)
    tensor_parallel.groups(d, cfg.tp_size)  # d.tp: this rank's place in its decoding group (every rank makes all)
    # several processes: load on the CPU, fully_shard moves each process's shard to its device
    load_device = "cpu" if d.world_size > 1 else d.device
    tokenizer, policy, ref = load_models(cfg, d, load_device)
    # which way each phase runs the model, decided once and kept on the models for the sampler and the training
    # forward; asked inside the root's forward, where they run: a sharded policy's embeddings and head are whole
    # only there (every rank takes part: the root's weights are gathered)
    paths = policy(functools.partial(transformer.decide, tp_size=cfg.tp_size))
    sharding.free_gathered(policy)
    for model in (policy, ref) if ref is not None else (policy,):  # the reference: the same layers, frozen
        transformer.attach(model.lm, paths)
    responses.set_response_template(tokenizer, cfg.chat_template_kwargs)  # how its family writes a turn, if known
    task, weights, reward_model = load_task(cfg, d, tokenizer, own_rewards, load_device)
    optimizer = make_optimizer([p for p in policy.parameters() if p.requires_grad], cfg)
    eos_ids = model_loading.eos_token_ids(policy.lm, tokenizer)
    agent = load_agent(cfg, tokenizer, eos_ids, task, weights)
    sharding.return_host_memory()  # what loading and the start-up check read and freed
    fp16 = d.mesh is not None and sharding.mixed_precision_dtypes(cfg.mixed_precision, d.device)[0] == torch.float16
    return Run(cfg, d, tokenizer, policy, ref, eos_ids, task, weights, reward_model, optimizer, agent,
               entropy_coef=cfg.entropy_coef, images=load_images(cfg, policy.lm, tokenizer, task), paths=paths.banner(),
               loss_scale=sharding.LossScale() if fp16 else None, reference=ref)


def load_images(cfg, model, tokenizer, task):
    """The encoder of prompts' images (layers/vision.py) for a vision-language policy, else None; a task whose prompts
    hold images and a policy that cannot see them, or a setting that does not carry images, stop the run."""
    path = os.path.join(cfg.out_dir, "tiny_model_init") if cfg.model == model_loading.TINY else cfg.model
    try:
        encoder = vision.ImageEncoder.for_model(model, tokenizer, vision.load_image_processor(path)
                                                if vision.is_vision_model(model) else None)
    except ValueError as e:
        raise SystemExit(f"model: {e}") from e
    row = task.prompts_for_step(cfg.seed, 1, 1)[0] if task.rows or task.make_prompts else {}
    if vision.row_images(row) and encoder is None:
        why = ("images in prompts run on the Qwen-VL family's layout (Qwen2.5-VL, Qwen3-VL, Qwen3.5) only"
               if getattr(model.config, "vision_config", None) is not None else "it has no vision tower")
        raise SystemExit(f"task {cfg.task}: its prompts hold images, and {type(model).__name__} cannot see them: "
                         f"{why}")
    if encoder is not None and cfg.dynamic_sampling:
        raise ConfigError("dynamic_sampling", "not supported with a vision-language model's image prompts yet")
    if vision.is_vision_model(model) and cfg.shared_prompts:  # it would do nothing: say so rather than ignore it
        raise ConfigError("shared_prompts", f"has no effect on {type(model).__name__}: a vision-language model samples "
                                            f"and trains each row's prompt on its own forward; leave it off")
    return encoder


def load_agent(cfg, tokenizer, eos_ids, task, weights):
    """The run's tools and environment (the task's own environment unless --environment names one), or None.
    An environment with get_reward adds its score to the task's rewards, weight 1."""
    try:
        tools = environments.load_tools(cfg.tools) if cfg.tools else []
    except ValueError as e:
        raise ConfigError("tools", e) from e
    try:
        environment = environments.load_environment(cfg.environment) if cfg.environment else task.environment
    except ValueError as e:
        raise ConfigError("environment", e) from e
    if not tools and environment is None:
        return None
    try:
        agent = environments.Agent(tokenizer, eos_ids, tools, environment, max_turns=cfg.max_turns,
                             timeout=cfg.tool_timeout, system_prompt=task.system_prompt,
                             chat_template_kwargs=cfg.chat_template_kwargs)
        agent.check_template()  # a template that does not show the tools stops the run here
    except ValueError as e:
        raise ConfigError("environment" if environment is not None else "tools", e) from e
    task.reward_funcs.extend(agent.reward_funcs)
    weights.extend([1.0] * len(agent.reward_funcs))
    return agent


def check_sandbox(cfg, d):
    """The mode of sandbox/executor.py for what runs model-written code; a task that runs code (and strict, always) checks at
    start-up that this machine can give it, and stops naming what is missing. Unsafe says so in the banner."""
    os.environ["GRPO_SANDBOX"] = cfg.sandbox  # the executor's default: the code task's reward and the python tool
    if cfg.task == "code" or cfg.sandbox == "strict":
        try:
            executor.check(cfg.sandbox)
        except executor.ExecutorUnavailable as e:
            raise ConfigError("sandbox", e) from e
    if cfg.sandbox == "unsafe" and d.master:
        print(executor.UNSAFE_BANNER, flush=True)


def _local_tiny(cfg, d, name, write):
    """The folder of a tiny model written into out_dir (by the master; the others wait until it is there)."""
    path = os.path.join(cfg.out_dir, name)
    if d.master:
        write(path)
    sharding.barrier(d)
    return path


def load_models(cfg, d, load_device):
    """The tokenizer, the policy and the reference (None when beta == 0 or with LoRA), each sharded.

    Several processes and a local folder of safetensors weights: each process builds the model with its
    parameters on the meta device (with LoRA's adapters, and routing replay's routers wrapped; a vision-language
    model's vision tower beside its language model), shards it, and reads only its own shards from the files, the
    reference too (`_load_sharded`); about P/W bytes per process where the whole model would be P. Otherwise (one
    process, the tiny model and other folders without weights, hub ids not in the cache) the whole model is built
    in each process, the reference copied from it, and both sharded after."""
    # a task may bring its own tiny model's chat template and tokens (the vault task's tool calls)
    write = tasks.tiny_model_writer(cfg.task, model_loading.write_tiny_model)
    path = _local_tiny(cfg, d, "tiny_model_init", write) if cfg.model == model_loading.TINY else cfg.model
    check_tp_size(cfg, path)
    if d.master:
        print(f"loading {cfg.model} on {load_device} ...", flush=True)
    start = time.perf_counter()
    sharded = d.world_size > 1 and cfg.model != model_loading.TINY
    try:
        path = model_loading.model_folder(path, cfg.model_init_kwargs)  # a hub id: its folder in the cache, if there
        tokenizer = model_loading.load_tokenizer(path)
        empty, why = model_loading.empty_model(path, cfg.model_init_kwargs, gradient_checkpointing=
                                               cfg.gradient_checkpointing, adapt=functools.partial(add_adapters, cfg)
                                               ) if sharded else (None, None)
        if empty is None:
            policy = model_loading.load_model(path, cfg.model_init_kwargs, load_device, seed=cfg.seed,
                                              gradient_checkpointing=cfg.gradient_checkpointing)
    except model_loading.InitKwargsError as e:  # an attention implementation the model does not have, ...
        raise ConfigError("model_init_kwargs", str(e).removeprefix("model_init_kwargs: ")) from e
    except (OSError, ValueError) as e:  # a missing folder, damaged weights: one line (GRPO_DEBUG=1: the traceback)
        raise SystemExit(f"model: {e}") from e
    except TypeError as e:  # from_pretrained given a keyword the model does not take
        raise ConfigError("model_init_kwargs", e) from e
    if cfg.cpu_offload and d.mesh is None:
        raise ConfigError("cpu_offload", "needs torchrun (FSDP2 shards what it offloads); one plain process has none")
    if empty is not None:
        policy, ref = _load_sharded(cfg, d, path, empty)
        how = "each process read its own shards"
    else:
        policy, ref = _load_whole(cfg, d, policy)
        how = "the whole model in each process" + (f" ({why})" if why else "")
    if d.master:
        dequantized = model_loading.checkpoint_quantization(path, cfg.model_init_kwargs)
        how += f"; quantization_config {dequantized}: its experts dequantized" if dequantized else ""
        print(f"loaded in {time.perf_counter() - start:.1f} s: {how}", flush=True)
    return tokenizer, policy, ref


def check_tp_size(cfg, path):
    """Stop, in one line naming the family and the reason, a --tp_size the sampler cannot split the model at `path`
    over: asked of the model built from its config on the meta device, before any weight is read (every rank
    meets it alike; rank 0 says it)."""
    if cfg.tp_size == 1:
        return
    from runs import plan
    try:
        config = plan.model_config(dataclasses.replace(cfg, model=path))
        model = plan.meta_model(config, torch.float32, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
    except (OSError, ValueError):  # a folder, hub id or LoRA target that loading names in its own line
        return
    why = plan.tp_verdict(model, cfg.tp_size)
    if why:
        raise ConfigError("tp_size", why)


def add_adapters(cfg, model):
    """LoRA's adapters on `model` (whole, or on the meta device before sharding) when --lora_rank asks for them:
    adapters only are trained, and the reference is then the policy with them switched off."""
    if cfg.lora_rank:
        try:
            lora.add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
        except ValueError as e:
            raise ConfigError("lora_target_modules", str(e).removeprefix("lora_target_modules: ")) from e


def replay_routing(cfg, models):
    """With --routing_replay, each model's routers wrapped to record and replay for that model alone."""
    if cfg.routing_replay:
        try:
            for model in models:
                routing.of(model)
        except ValueError as e:
            raise ConfigError("routing_replay", e) from e


def _load_whole(cfg, d, policy):
    """The policy (loaded whole) with its adapters, checked, its reference copied from it, both sharded."""
    add_adapters(cfg, policy)
    check_model(cfg, d, policy)  # with the adapters (zero at start): the paths the run takes
    ref = model_loading.build_reference_model(policy, 0 if cfg.lora_rank else cfg.beta)
    if ref is not None and cfg.ref_bf16:
        ref.to(torch.bfloat16)
    # after the reference is copied: each model's routers record and replay for it alone
    replay_routing(cfg, (policy, ref) if ref is not None else (policy,))
    warn_low_precision(cfg, d, policy)
    supported = not cfg.compile_layers or transformer.decide(policy).trains_written_out(policy.train())  # as it trains
    if not supported and d.master:
        warn_not_compiled()
    # both wrapped so that every call into them is one forward of the FSDP root (see sharding.Root)
    policy = sharding.shard(sharding.Root(policy), d, cfg.mixed_precision, cfg.cpu_offload).train()
    if ref is not None:
        ref = sharding.shard(sharding.Root(ref), d, cfg.mixed_precision, cfg.cpu_offload).eval()
        sharding.check_same_placement(policy, ref)
    return policy, ref


def _load_sharded(cfg, d, path, empty):
    """The policy and the reference, each built on the meta device, sharded as sharding.shard does, then filled
    with this process's shards from the folder's files; the start-up check runs on the sharded policy. LoRA's
    adapters were added on meta (`empty_model`'s adapt) and take their values in the fill, as add_lora gives
    them on a whole model; with LoRA there is no reference (the policy with its adapters off)."""
    replay_routing(cfg, (empty,))
    policy = sharding.shard(sharding.Root(empty), d, cfg.mixed_precision, cfg.cpu_offload)
    model_loading.fill_shards(policy, path, d.device).train()
    check_model(cfg, d, policy, sharded=True)
    warn_low_precision(cfg, d, policy)
    if cfg.compile_layers and not policy(lambda lm: transformer.decide(lm).trains_written_out(lm.train())):
        if d.master:
            warn_not_compiled()
    sharding.free_gathered(policy)
    ref = None
    if cfg.beta > 0 and not cfg.lora_rank:  # from the same files, not copied from the policy: no process holds either
        lm, _ = model_loading.empty_model(path, cfg.model_init_kwargs, dtype=torch.bfloat16 if cfg.ref_bf16 else None)
        lm.requires_grad_(False)
        replay_routing(cfg, (lm,))
        ref = sharding.shard(sharding.Root(lm), d, cfg.mixed_precision, cfg.cpu_offload)
        model_loading.fill_shards(ref, path, d.device).eval()
        sharding.check_same_placement(policy, ref)
    return policy, ref


def warn_low_precision(cfg, d, policy):
    low = {p.dtype for p in policy.parameters() if p.requires_grad} & {torch.bfloat16, torch.float16}
    if low and cfg.lr < 1e-4 and d.master:
        print(f"warning: training {low.pop()} weights at lr={cfg.lr:g}: most AdamW updates are smaller than the "
              f"weights' rounding step and are lost; load float32 weights (no dtype in model_init_kwargs) and let "
              f"torchrun + FSDP2 compute in bfloat16", flush=True)


def warn_not_compiled():
    print("warning: compile_layers has no effect here: this model trains through the Hugging Face forward "
          "(attention dropout, or an architecture without written-out training layers), which is not compiled",
          flush=True)


def check_model(cfg, d, policy, sharded=False):
    """Stop, naming the architecture and what is wrong, where the sampler's or the training forward's log-probs
    would not be the model's own (sampling.check_exact: a few tokens through both).

    A model loaded whole is checked on rank 0 before sharding. A sharded policy (each process read its own
    shards) is checked on every rank inside the root's forward, as the sampler runs it under FSDP2: no rank
    holds the whole model to check it, and each gathers one block at a time. Its weights are then as the run
    computes with them: in bfloat16 under --mixed_precision bf16 (a GPU's default), where check_exact compares
    nothing (rounding would hide what it looks for), which a line says."""
    def run_check(fn):  # fn(lm) on the model as it is here: whole, or inside the sharded root's forward
        if not sharded:
            return fn(policy)
        try:
            return policy(fn)
        finally:
            sharding.free_gathered(policy)
    if not cfg.check_model:
        try:  # what the sampler cannot run at all still stops here, rather than inside the model's forward at step 1
            run_check(hf_decoder.check_layer_types)
        except ValueError as e:
            raise SystemExit(f"model: {e}; --check_model=false cannot skip this") from e
        return
    problem = None
    if d.master or sharded:
        try:
            # sharded, the sampler checked is the one the run uses: sliced over its tensor-parallel group
            problem = run_check(functools.partial(sampling.check_exact, tp=d.tp if sharded else None))
        except Exception as e:  # noqa: BLE001 (said in one line on every rank, not a traceback on one)
            name = type(policy.lm if sharded else policy).__name__
            problem = f"{name}: the check itself failed: {type(e).__name__}: {e}"
    problem = sharding.first_problem(problem, d) if sharded else sharding.broadcast_object(problem, d)
    if problem:
        raise SystemExit(f"model: {problem}. This architecture cannot be trained exactly here "
                         f"(docs/architectures.md); --check_model=false skips this check at your own risk")
    low = sharding.mixed_precision_dtypes(cfg.mixed_precision, d.device)[0]
    if sharded and d.master and low is not None:
        print(f"note: check_model compared no log-probs: the sharded policy computes in {str(low)[6:]} here "
              "(--mixed_precision=fp32 checks them in float32)", flush=True)


def load_task(cfg, d, tokenizer, own_rewards, load_device):
    """Prompts, reward functions (plus a reward model's score) and their weights, held-out evaluation prompts."""
    rm_path = cfg.reward_model or tasks.default_reward_model(cfg.task)
    if rm_path == model_loading.TINY:
        rm_path = _local_tiny(cfg, d, "tiny_reward_model_init", model_loading.write_tiny_reward_model)
    reward_model = None  # (model behind its root wrapper, its own tokenizer)
    if rm_path:
        try:
            rm, rm_tokenizer = model_loading.load_reward_model(rm_path, cfg.model_init_kwargs, load_device,
                                                               cfg.seed + 1)
        except (OSError, ValueError) as e:
            raise SystemExit(f"reward_model: {e}") from e
        # sharded like the reference; every rank scores as many completions in as many forwards
        reward_model = (sharding.shard(sharding.Root(rm), d, cfg.mixed_precision).eval(), rm_tokenizer)
    try:
        task = tasks.get_task(cfg.task, tokenizer=tokenizer, dataset=cfg.dataset, seed=cfg.seed,
                              chat_template_kwargs=cfg.chat_template_kwargs,
                              eval_prompts=cfg.eval_prompts if cfg.eval_every or cfg.eval_only else 0,
                              reward_model=reward_model,
                              reward_funcs=own_rewards)
    except (ValueError, OSError) as e:
        raise SystemExit(f"task {cfg.task}: {e}") from e
    weights = cfg.reward_weights or task.weights or [1.0] * len(task.reward_funcs)
    if len(weights) != len(task.reward_funcs):
        raise ConfigError("reward_weights", f"{len(weights)} weights for {len(task.reward_funcs)} reward functions "
                          f"({', '.join(rewards.reward_name(f) for f in task.reward_funcs)})")
    return task, weights, reward_model
