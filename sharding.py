"""Several processes: distributed setup, FSDP2 sharding, gathering for generation, checkpoints; and, within
one CPU process, micro-batches on threads.

One process (plain `python train.py`) is the special case where every helper
here is the identity: no process group, no mesh, nothing sharded.
"""

import collections
import concurrent.futures
import contextlib
import glob
import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------- setup


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    mesh: object = None  # a 1-D DeviceMesh over all processes; None with one process

    @property
    def master(self):  # only this process prints, logs and exports
        return self.rank == 0


def setup(device=None):
    """Read RANK / LOCAL_RANK / WORLD_SIZE set by torchrun; without them, one process.

    NCCL on CUDA, gloo on CPU. `device` ("cpu", "cuda") overrides the choice.
    """
    use_cuda = torch.cuda.is_available() if device in (None, "", "auto") else str(device).startswith("cuda")
    if "RANK" not in os.environ:
        return Dist(0, 0, 1, torch.device(device if use_cuda and ":" in str(device) else "cuda" if use_cuda else "cpu"))
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    mesh = None
    if world > 1 or dev.type == "cuda":  # one GPU under torchrun too: FSDP2's bf16 compute over fp32 weights
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    return Dist(rank, local_rank, world, dev, mesh)


def teardown():
    if dist.is_initialized():
        # every rank gets here before any tears down: a rank destroying its gloo group while another still
        # talks to it can abort the other ("terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- sharding


class Root(torch.nn.Module):
    """`root(fn, *args)` runs `fn(lm, *args)` inside this module's forward.

    FSDP2 gathers a module's parameters in hooks around its forward. The
    trainer reaches into the language model in ways its own forward does not
    cover: `grpo.completion_logprobs` runs `lm.base_model` and then multiplies
    by the output-embedding weight itself, chunk by chunk, and the sampler
    runs a whole decode loop. Called on a sharded language model, those would
    bypass the root's hooks and see the root's parameters (embeddings, final
    norm, lm_head, tied or not) still sharded. Wrapping the model in this
    module and sharding it as the root makes each such call one root forward:
    the hooks gather the root's parameters before `fn` and reduce their
    gradients after backward, and `fn` stays plain code about a plain model.
    Unsharded (one process) it only calls `fn`.
    """

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    @property
    def config(self):
        return self.lm.config

    def forward(self, fn, *args, **kwargs):
        return fn(self.lm, *args, **kwargs)


def transformer_blocks(lm):
    """The repeated decoder layers of a Hugging Face causal LM (model.layers in Llama/Qwen/Mistral...)."""
    layers = getattr(lm.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"shard: found no decoder layers at {type(lm.base_model).__name__}.layers; "
                         "this model's block list must be named for fully_shard")
    return list(layers)


def mixed_precision_dtypes(setting, device):
    """(param_dtype, reduce_dtype) for Config.mixed_precision: auto = bf16 compute with fp32 reduction on GPU."""
    if setting == "auto":
        setting = "bf16" if device.type == "cuda" else "fp32"
    if setting == "bf16":
        return torch.bfloat16, torch.float32
    if setting == "fp32":
        return None, None  # compute in the parameters' own dtype
    raise ValueError(f"mixed_precision: unknown value {setting!r} (auto, bf16 or fp32)")


def shard(root, d, mixed_precision="auto"):
    """fully_shard each transformer block, then the root (torchtitan's layout); identity with one process.

    Each block is gathered just before its forward and freed after it, so a
    GPU holds its 1/W share of all parameters, gradients and optimizer state
    plus one block's full weights at a time. The root group holds what is
    outside the blocks: embeddings, final norm, lm_head (one tensor when tied).
    """
    if d.mesh is None:
        return root
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype, reduce_dtype = mixed_precision_dtypes(mixed_precision, d.device)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in transformer_blocks(root.lm):
        fully_shard(block, mesh=d.mesh, mp_policy=mp)
    fully_shard(root, mesh=d.mesh, mp_policy=mp)
    # completion_logprobs returns views (reshapes of a cat); nothing modifies them in place, which is
    # what FSDP warns about
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return root


def placement(module):
    """{(device, mesh)} of a module's parameters; a sharded model's are DTensors on the mesh's device."""
    return {(p.device, getattr(p, "device_mesh", None)) for p in module.parameters()}


def check_same_placement(policy, ref):
    """The reference must sit where the policy sits: same device, same mesh (never left behind on the CPU)."""
    if placement(ref) != placement(policy):
        raise RuntimeError(f"reference model: parameters on {placement(ref)}, policy on {placement(policy)}; "
                           "the reference must be sharded on the policy's mesh and device")


def fsdp_modules(root):
    """Every module with its own FSDP parameter group (the blocks and the root); none when unsharded."""
    from torch.distributed.fsdp import FSDPModule
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(root):
    """Keep the full parameters gathered for a whole decode loop; free them after.

    For the Hugging Face forward: without this each block would be all-gathered
    and freed again for every generated token. Inside, a block's first forward
    (the prefill) gathers it and nothing frees it until the `with` ends: one
    all-gather per block for the whole loop. Cost: every parameter in the
    compute dtype (2 bytes each in bf16) on every rank, on top of the shards,
    while generating. Llama/Qwen2 models decode with `static_decoder.StaticDecoder`
    instead, which gathers each block once for its own copy and frees it at
    once (the same 2 bytes per parameter, held by the copy); its blocks never
    run a forward here, so this context only changes what they would do.
    """
    modules = fsdp_modules(root)
    blocks = [m for m in modules if m is not root]
    for m in blocks:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield root
    finally:
        for m in blocks:
            m.set_reshard_after_forward(True, recurse=False)
        for m in modules:
            m.reshard()


def free_gathered(root):
    """Release the root group's gathered parameters (FSDP keeps the root's after a forward for backward)."""
    for m in fsdp_modules(root):
        m.reshard()


# ----------------------------------------------------------------------------- collectives


def barrier(d):
    """Wait for every rank (nothing to wait for with one process)."""
    if d.world_size > 1:
        dist.barrier()


def all_done_fn(d):
    """A stop rule for grpo.sample that agrees across ranks: stop only when every rank's rows are done.

    Every rank then runs the same number of forwards, so one whose completions
    ended early keeps serving the collectives of the others instead of leaving
    them waiting forever.
    """
    if d.world_size == 1:
        return None  # the sampler's own rule

    def all_done(done):
        flag = done.all().to(device=d.device, dtype=torch.int32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())
    return all_done


def all_gather_rows(x, d):
    """Concatenate each rank's rows (dim 0) in rank order; the same shape on every rank is required."""
    if d.world_size == 1:
        return x
    local = x.to(d.device)
    parts = [torch.empty_like(local) for _ in range(d.world_size)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts).to(x.device)


def all_reduce_sum(values, d):
    """Sum a list of floats over all ranks (one collective)."""
    if d.world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return t.tolist()


def full_tensor(x):
    """A DTensor's full value (a collective); a plain tensor as it is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


# ----------------------------------------------------------------------------- threads (one CPU process)


class MicroBatchWorkers:
    """A step's micro-batches computed `n` at a time on CPU threads, each thread with its share of torch's threads.

    One micro-batch of a small model leaves a few cores under-used: products of small matrices gain little
    from a second thread, and every elementwise pass starts and joins its threads. Two micro-batches at once,
    each on half the threads (one of two), keep both cores busy: on 2 cores the bench step's training phase
    runs 1.3x to 1.5x faster. This works because torch releases the GIL inside operations and autograd runs
    a CPU backward on the thread that calls it. `map` returns results in order, and `accumulate` adds
    gradients in that order, as successive `backward()` calls would. With n == 1 everything runs here, as
    plain code. The price is memory: n micro-batches' activations at once, and up to 2n micro-batches'
    gradients computed but not yet added.
    """

    @staticmethod
    def count(setting, d, model):
        """The number of workers for the Config value `setting` (0 = choose); ValueError when threads cannot
        share this run's micro-batches.

        FSDP2's hooks expect one backward at a time, and a GPU runs one micro-batch's kernels in a stream anyway.
        """
        why = (f"threads share micro-batches on CPU only, not {d.device}" if d.device.type != "cpu" else
               f"threads share micro-batches within one process only, not {d.world_size}" if d.world_size > 1 else
               MicroBatchWorkers.unsafe(model))
        if setting > 1 and why:
            raise ValueError(why)
        if setting:
            return setting
        return 1 if why or torch.get_num_threads() < 2 else 2

    @staticmethod
    def unsafe(model):
        """Why two threads may not run this model's forward at once (None when they may).

        Dropout: the masks come from one generator, drawn in whatever order the threads reach it, and under
        activation checkpointing a recomputed mask can differ from the forward's. Dynamic and long-context
        rotary embeddings rewrite their frequency table inside the forward.
        """
        for key, value in model.config.to_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) and value > 0:
                return f"threads cannot share this model's forward: config.{key} = {value} (dropout)"
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Dropout) and module.p > 0:
                return f"threads cannot share this model's forward: {name} is dropout with p = {module.p}"
            rope = str(getattr(module, "rope_type", ""))
            if "dynamic" in rope or rope == "longrope":
                return (f"threads cannot share this model's forward: {name} ({rope} rotary embedding) rewrites "
                        f"its frequency table in the forward")
        return None

    def __init__(self, n):
        self.n = n
        self.threads = max(1, torch.get_num_threads() // n)
        self.pool = None
        if n > 1:
            # each worker sets its own thread count as it starts (OpenMP keeps one per thread)
            self.pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="micro-batch", initializer=torch.set_num_threads,
                                           initargs=(self.threads,))

    def map(self, fn, items):
        """fn(x) for each x in items, n at a time: an iterator over the results, in order.

        At most 2n are submitted and not yet returned, so finished results wait for a slow one in bounded number.
        """
        if self.pool is None:
            yield from map(fn, items)
            return
        mine = torch.get_num_threads()
        pending = collections.deque()
        try:
            for x in items:
                if len(pending) == 2 * self.n:
                    yield pending.popleft().result()
                pending.append(self.pool.submit(fn, x))
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:  # after an error: what has not started never will
                future.cancel()
            torch.set_num_threads(mine)  # a worker setting its count also moved the default for threads started later

    def backward(self, loss, params):
        """loss.backward() with one worker; with several, the gradients of `params` returned, for `accumulate`."""
        if self.pool is None:
            loss.backward()
            return None
        return torch.autograd.grad(loss, params, allow_unused=True)

    @staticmethod
    def accumulate(params, grads):
        """Add one micro-batch's gradients (from `backward`) to `params`' .grad, as autograd accumulates them.

        A first gradient is copied into a tensor laid out like its parameter (autograd may return one tensor
        for two parameters, or another memory layout); later ones are added in place.
        """
        if grads is None:
            return
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = torch.empty_like(p).copy_(g) if p.grad is None else p.grad.add_(g)



# ----------------------------------------------------------------------------- checkpoints
#
# out_dir/checkpoints/step_00000004/
#     __0_0.distcp ... .metadata    model and optimizer, torch.distributed.checkpoint (any world size loads them)
#     trainer.pt                     step, LR schedule, wandb run id (rank 0)
#     rng_<rank>.pt                  torch / CUDA / Python random states of each rank
#     manifest.json                  written last: file names and sizes; a folder without it is not a checkpoint
# A checkpoint is written into .tmp_step_... and renamed when complete.

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"


def _checkpoint_dirs(out_dir):
    """Checkpoint folders (step_<digits>), newest first; anything else in the folder is ignored."""
    found = [p for p in glob.glob(os.path.join(out_dir, CHECKPOINTS, "step_*"))
             if os.path.basename(p)[len("step_"):].isdigit()]
    return sorted(found, key=lambda p: int(os.path.basename(p)[len("step_"):]), reverse=True)


def _rng_state():
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir, step, model, optimizer, trainer_state, d, keep=2):
    """Write a complete checkpoint for `step` (collective: every rank calls it); keep the newest `keep`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    final = os.path.join(out_dir, CHECKPOINTS, f"step_{step:08d}")
    tmp = os.path.join(out_dir, CHECKPOINTS, f".tmp_step_{step:08d}")
    if d.master:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
        os.makedirs(tmp)
    barrier(d)
    free_gathered(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings():  # one process: DCP warns that it saves without a process group, as asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=tmp, no_dist=d.world_size == 1)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_{d.rank}.pt"))
    if d.master:
        torch.save({**trainer_state, "step": step, "world_size": d.world_size}, os.path.join(tmp, "trainer.pt"))
    barrier(d)  # every rank's files are written
    if d.master:
        files = {f: os.path.getsize(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump({"step": step, "world_size": d.world_size, "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in _checkpoint_dirs(out_dir)[max(1, keep):]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(d)
    return final


def _check_manifest(path):
    """None when the folder holds every file its manifest lists, at the listed size; else what is wrong."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest):
        return f"no {MANIFEST} (incomplete)"
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable {MANIFEST}: {e}"
    for name, size in files.items():
        p = os.path.join(path, name)
        if not os.path.exists(p):
            return f"missing {name}"
        if os.path.getsize(p) != size:
            return f"{name} has {os.path.getsize(p)} bytes, the manifest says {size}"
    return None


def _copy_state(state):
    """A detached copy to load into, so a load that fails half-way leaves the live model untouched."""
    if isinstance(state, dict):
        return {k: _copy_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy_state(v) for v in state]
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state


def load_latest_checkpoint(out_dir, model, optimizer, d):
    """Load the newest complete checkpoint in out_dir into model and optimizer (collective).

    Returns the trainer state saved with it (step, LR schedule, wandb id, ...),
    or None when there is none. A damaged or incomplete checkpoint is skipped
    with a warning naming it; the one before it is tried. Loading goes into a
    copy first and reaches the model only once every tensor was read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException  # a BaseException: not caught by `except Exception`
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    paths = _checkpoint_dirs(out_dir)
    if d.world_size > 1:  # rank 0's listing for all: ranks that saw different files would diverge in collectives
        shared = [paths]
        dist.broadcast_object_list(shared, src=0)
        paths = shared[0]
    skipped = []
    for path in paths:
        problem = _check_manifest(path)
        # agree on the manifest verdict before dcp.load, itself a collective
        if all_reduce_sum([float(problem is not None)], d)[0]:
            problem = problem or "incomplete on another rank"
        if problem is None:
            try:
                state = _copy_state({"model": get_model_state_dict(model),
                                     "optim": get_optimizer_state_dict(model, optimizer)})
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.load(state, checkpoint_id=path, no_dist=d.world_size == 1)
                trainer_state = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
                rng_file = os.path.join(path, f"rng_{d.rank}.pt")
                rng = torch.load(rng_file, weights_only=False) if os.path.exists(rng_file) else None
            except (Exception, CheckpointException) as e:  # any failure to read means: not this one
                problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        # every rank must pick the same checkpoint
        failed = all_reduce_sum([float(problem is not None)], d)[0]
        if failed:
            if d.master:
                warnings.warn(f"skipping checkpoint {path}: {problem or 'failed to load on another rank'}",
                              stacklevel=2)
            skipped.append(f"{path}: {problem or 'failed to load on another rank'}")
            continue
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        if rng is not None:
            _set_rng_state(rng)
        trainer_state["path"] = path
        return trainer_state
    optimizer.state.clear()  # get_optimizer_state_dict initialised AdamW's state: a fresh start has none
    if skipped:
        # starting over would overwrite this run's checkpoints and metrics: stop and say why instead
        raise SystemExit("out_dir holds checkpoints but none could be loaded (a different model, config or "
                         "damaged files?):\n  " + "\n  ".join(skipped) +
                         "\nUse another --out_dir to start a new run, or remove these folders.")
    return None


# ----------------------------------------------------------------------------- export


def full_state_dict(root):
    """Every parameter as a full CPU tensor, names as in the bare language model (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    free_gathered(root)  # the root group may still hold unsharded tensors from its last forward
    sd = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("lm."): v for k, v in sd.items()}
