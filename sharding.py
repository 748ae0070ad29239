"""Several processes: distributed setup, FSDP2 sharding, gathering for generation, checkpoints.

One concern, past 650 lines on purpose: what the processes of a run hold and share (their group and its
tensor-parallel groups, their shards and the host memory under them, the collectives, the run's folder and the
checkpoints saved and loaded shard by shard). One process (plain `python train.py`) is the special case where
every helper here is the identity: no process group, no mesh, nothing sharded.
"""

import contextlib
import datetime
import fcntl
import functools
import glob
import json
import math
import os
import random
import shutil
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from layers.shards import dim0_mesh, is_shard  # noqa: F401 (what a shard is, for runs/ too)
from runs import disk

# ----------------------------------------------------------------------------- setup


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    mesh: object = None  # the DeviceMesh FSDP2 shards over (`setup`); None with one process
    tp: object = None  # this rank's share of a tensor-parallel group when the sampler decodes in groups
    replicas: int = 1  # HSDP: copies of the sharded model, each over world_size / replicas processes; 1 = flat
    nodes: int = 1  # the nodes torchrun formed the run of (WORLD_SIZE / LOCAL_WORLD_SIZE)

    @property
    def master(self):  # only this process prints, logs and exports
        return self.rank == 0

    @property
    def shards(self):  # the processes one replica's shards are spread over
        return self.world_size // self.replicas

    def describe(self):
        """The mesh in words, for the banner."""
        if self.replicas == 1:
            return f"{self.world_size} shards" + (f" over {self.nodes} nodes" if self.nodes > 1 else "")
        per_node = ", one replica per node" if self.replicas == self.nodes else ""
        return f"{self.replicas} replicas x {self.shards} shards{per_node}"


def nodes_and_local():
    """(nodes, processes per node) as torchrun formed the run: WORLD_SIZE / LOCAL_WORLD_SIZE; (1, 1) alone."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    local = local or world
    return max(1, world // local), local


def setup(device=None, mixed_precision="auto", replicas=1):
    """Read RANK / LOCAL_RANK / WORLD_SIZE set by torchrun; without them, one process.

    NCCL on CUDA, gloo on CPU. `device` ("cpu", "cuda") overrides the choice. A plain process asking for a
    mixed precision by name (bf16, fp16: FSDP2's MixedPrecisionPolicy is what applies it) runs as a world of one,
    as under `torchrun --nproc_per_node 1`.
    replicas: R > 1 builds HSDP's 2-D mesh, (replicate, shard) = (R, W / R): replica r is the consecutive ranks
    r * W / R ... (r + 1) * W / R - 1, so with one replica per node each replica's all-gathers and reduce-scatters
    stay inside a node and only the gradients' all-reduce crosses nodes (once per step). 1: one flat mesh.
    """
    use_cuda = torch.cuda.is_available() if device in (None, "", "auto") else str(device).startswith("cuda")
    alone = "RANK" not in os.environ
    if alone and mixed_precision not in ("bf16", "fp16"):
        return Dist(0, 0, 1, torch.device(device if use_cuda and ":" in str(device) else "cuda" if use_cuda else "cpu"))
    if alone:  # a process group of one, its store in this process
        index = torch.device(device).index if use_cuda and ":" in str(device) else None
        rank, local_rank, world = 0, index or 0, 1
        if use_cuda:
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1, device_id=torch.device("cuda", local_rank) if use_cuda else None)
    else:
        rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    mesh = None
    if world > 1:  # rank 0's choice for all: each process's own (its memory, its cache) could differ, and hang
        box = [replicas]
        dist.broadcast_object_list(box, src=0)
        replicas = box[0]
    if world % replicas:
        raise ValueError(f"{replicas} replicas do not divide the {world} processes")
    # one GPU under torchrun too: FSDP2's bf16 compute over fp32 weights; one CPU process where a precision is named
    if world > 1 or dev.type == "cuda" or mixed_precision in ("bf16", "fp16"):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",)) if replicas == 1 else \
            init_device_mesh(dev.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    return Dist(rank, local_rank, world, dev, mesh, replicas=replicas, nodes=nodes_and_local()[0] if not alone else 1)


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
    cover: `logprobs.completion_logprobs` runs `lm.base_model` and then multiplies
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
    """The repeated decoder layers of a Hugging Face causal LM (model.layers in Llama/Qwen/Mistral...; a
    vision-language model's model.language_model.layers, its vision tower staying with the root)."""
    inner = getattr(lm.base_model, "language_model", None) or lm.base_model
    layers = getattr(inner, "layers", None)
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
    if setting == "fp16":
        return torch.float16, torch.float32
    if setting == "fp32":
        return None, None  # compute in the parameters' own dtype
    raise ValueError(f"mixed_precision: unknown value {setting!r} (auto, bf16, fp16 or fp32)")


class LossScale:
    """Dynamic loss scaling, for float16 compute (--mixed_precision=fp16): float16 keeps 10 mantissa bits but 5
    exponent bits, so small gradients underflow to zero unless the loss is scaled up before backward. The loss is
    multiplied by `scale`, the gradients divided by it after (`unscale`, a power of two: exact); a step whose
    gradient is not finite (an overflow) is skipped and the scale halved, and after INTERVAL finite steps in a row
    it doubles (`update`): the scheme and the constants of torch.amp.GradScaler, written out so that it reads the
    same on one process and under FSDP2. Its state (`state`) is saved with the checkpoint: a resumed run scales as
    one that never stopped."""
    INIT, INTERVAL = 2.0 ** 16, 2000  # (an overflow at a scale of 1 or less is not the scale's: train.optimizer_step)

    def __init__(self, scale=INIT, good=0, overflows=0):
        self.scale, self.good, self.overflows = float(scale), int(good), int(overflows)
        self.reported = self.overflows  # the overflows `step_metrics` has counted

    def unscale(self, params):
        inv = 1.0 / self.scale
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)

    def update(self, finite):
        """After an optimizer step: `finite`, whether its gradient was (the step taken), else an overflow."""
        if finite:
            self.good += 1
            if self.good == self.INTERVAL:
                self.scale, self.good = self.scale * 2, 0
        else:
            self.scale, self.good, self.overflows = self.scale / 2, 0, self.overflows + 1

    def state(self):
        return {"scale": self.scale, "good": self.good, "overflows": self.overflows}

    def unreported(self):
        """The overflows since `step_metrics` last counted them (the step's so far)."""
        return self.overflows - self.reported

    def step_metrics(self):
        """The scale now, and the overflows since the last call (a step's)."""
        out = {"loss_scale": self.scale, "overflow_steps": self.overflows - self.reported}
        self.reported = self.overflows
        return out


def shard(root, d, mixed_precision="auto", cpu_offload=False):
    """fully_shard each transformer block, then the root (torchtitan's layout); identity with one process.

    Each block is gathered just before its forward and freed after it, so a
    GPU holds its 1/W share of all parameters, gradients and optimizer state
    plus one block's full weights at a time. The root group holds what is
    outside the blocks: embeddings, final norm, lm_head (one tensor when tied).
    cpu_offload: the shards (and so the gradients and AdamW's states, made where the shards are) stay in host
    memory; FSDP2 copies each group's shards to the device just before its all-gather (CPUOffloadPolicy), and
    the optimizer steps on the CPU. On a CPU-only machine the shards are on the CPU anyway: nothing moves.
    """
    if d.mesh is None:
        return root
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    param_dtype, reduce_dtype = mixed_precision_dtypes(mixed_precision, d.device)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=d.device.type == "cuda") if cpu_offload else OffloadPolicy()
    for block in transformer_blocks(root.lm):
        fully_shard(block, mesh=d.mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(root, mesh=d.mesh, mp_policy=mp, offload_policy=offload)
    # completion_logprobs returns views (reshapes of a cat); nothing modifies them in place, which is
    # what FSDP warns about
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return root


def all_reduce_after(root, d, last):
    """HSDP: the gradients' all-reduce across replicas (between nodes) at an optimizer step's `last` backward only;
    before it FSDP2 keeps each replica's reduce-scattered sums and adds them in (docs/design.md, "Several nodes")."""
    for m in fsdp_modules(root) if d.replicas > 1 else ():
        m.set_requires_all_reduce(last, recurse=False)


def placement(module):
    """{(device, mesh)} of a module's parameters; a sharded model's are DTensors on the mesh's device."""
    return {(p.device, getattr(p, "device_mesh", None)) for p in module.parameters()}


def check_same_placement(policy, ref):
    """The reference must sit where the policy sits: same device, same mesh (never left behind on the CPU)."""
    if placement(ref) != placement(policy):
        raise RuntimeError(f"reference model: parameters on {placement(ref)}, policy on {placement(policy)}; "
                           "the reference must be sharded on the policy's mesh and device")


def mix_weights(target, source, alpha):
    """target <- alpha * source + (1 - alpha) * target, parameter by parameter, in place (TR-DPO's reference update,
    as TRL's SyncRefModelCallback does it). Both sharded alike (`check_same_placement`): each rank mixes its own
    shards, no collective."""
    for m in fsdp_modules(target) + fsdp_modules(source):
        m.reshard()  # the registered parameters are then the shards (a root keeps its gathered ones after a forward)
    with torch.no_grad():
        for (name, t), (other, s) in zip(target.named_parameters(), source.named_parameters(), strict=True):
            t, s = (p.to_local() if hasattr(p, "to_local") else p for p in (t, s))
            if name != other or t.shape != s.shape:
                raise RuntimeError(f"mix_weights: {name} {tuple(t.shape)} and {other} {tuple(s.shape)} do not match")
            t.mul_(1 - alpha).add_(s, alpha=alpha)


def fsdp_modules(root):
    """Every module with its own FSDP parameter group (the blocks and the root); none when unsharded."""
    from torch.distributed.fsdp import FSDPModule
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def gathered(root):
    """Keep the full parameters gathered for a whole decode loop; free them after (`kept_gathered`). An unsharded
    model's are whole: then a context that does nothing."""
    modules = fsdp_modules(root)
    return kept_gathered(root, modules) if modules else contextlib.nullcontext(root)


@contextlib.contextmanager
def kept_gathered(root, modules):
    """A sharded model's full parameters kept gathered inside the `with`; `modules` its FSDP groups.

    For the Hugging Face forward: without this each block would be all-gathered
    and freed again for every generated token. Inside, a block's first forward
    (the prefill) gathers it and nothing frees it until the `with` ends: one
    all-gather per block for the whole loop. Cost: every parameter in the
    compute dtype (2 bytes each in bf16) on every rank, on top of the shards,
    while generating. Llama/Qwen2 models decode with `engine.StaticDecoder`
    instead, which gathers each block once for its own copy and frees it at
    once (the same 2 bytes per parameter, held by the copy); its blocks never
    run a forward here, so this context only changes what they would do.
    """
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


def _libc():
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def map_large_host_tensors(threshold=1 << 20):
    """Host tensors above `threshold` bytes get a mapping of their own, unmapped when freed (glibc's
    M_MMAP_THRESHOLD; elsewhere nothing). By default glibc raises that threshold up to 32 MiB as large blocks are
    freed, and keeps what is freed below it in the process's heap for reuse: a layer gathered and freed, the
    sampler's copies of the weights freed after each rollout, then count against the process for the rest of the
    run, and a sharded process would hold far more than its shards. Each mapping costs a system call and page
    faults, nothing beside a tensor of a megabyte's arithmetic."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, threshold)  # -3: M_MMAP_THRESHOLD; setting it also stops glibc from raising it


RETURN_AT = 256 << 20  # bytes freed: below this, the heap's reuse is worth more than the memory given back


def return_host_memory(freed=None):
    """Give the freed heap memory back to the system (glibc's malloc_trim; elsewhere nothing): called where a phase
    ends and the next allocates other tensors (after loading and the start-up check, after sampling). `freed`: about
    how many bytes the phase freed; under RETURN_AT nothing is done, as the next phase would fault those pages in
    again (a tiny model's step took 3-7% longer on a CPU with a trim after each rollout)."""
    if freed is None or freed >= RETURN_AT:
        _malloc_trim()


def _malloc_trim():
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def free_gathered(root):
    """Release the root group's gathered parameters (FSDP keeps the root's after a forward for backward).

    Also forgets FSDP's record of the forwards run since the last backward, which only a backward clears: for a
    model that never runs one (the reference, a reward model) it would grow by a few entries per forward for the
    whole run. Call it where no backward is pending.
    """
    for m in fsdp_modules(root):
        m.reshard()
        _forget_forwards(m)


def _forget_forwards(module):
    """Clear an FSDP2 group's per-forward records (kept for backward prefetching). Private state, whose
    layout differs between torch versions: one group per module (2.11) or a list (2.13)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
    for group in groups:
        if hasattr(group, "_post_forward_indices"):
            group._post_forward_indices.clear()
        order = getattr(getattr(group, "comm_ctx", None), "post_forward_order", None)
        if order is not None:
            order.clear()


# ----------------------------------------------------------------------------- collectives


def barrier(d):
    """Wait for every rank (nothing to wait for with one process)."""
    if d.world_size > 1:
        dist.barrier()


def all_done_fn(d):
    """A stop rule for sampling.sample that agrees across ranks: stop only when every rank's rows are done.

    Every rank then runs the same number of forwards, so one whose completions ended early keeps serving the
    collectives of the others instead of leaving them waiting forever.
    """
    return None if d.world_size == 1 else functools.partial(_all_ranks_done, d)  # one process: the sampler's own rule


def _all_ranks_done(d, done):
    """Whether every rank's rows are `done` (a collective)."""
    flag = done.all().to(device=d.device, dtype=torch.int32).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def all_gather_rows(x, d):
    """Concatenate each rank's rows (dim 0) in rank order; the same shape on every rank is required."""
    return x if d.world_size == 1 else _gather_rows(x, d)


def _gather_rows(x, d):
    local = x.to(d.device)
    parts = [torch.empty_like(local) for _ in range(d.world_size)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts).to(x.device)


def all_reduce_sum(values, d):
    """Sum a list of floats over all ranks (one collective)."""
    return list(values) if d.world_size == 1 else _sum_over_ranks(values, d)


def _sum_over_ranks(values, d):
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return t.tolist()


def broadcast_object(obj, d):
    """Rank 0's `obj` (any picklable value) on every rank; as it is with one process."""
    if d.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(obj, d):
    """Every rank's picklable `obj`, in rank order, on every rank (one collective). Tensors inside must be on the
    CPU: a pickled CUDA tensor would come back on the device of the rank that sent it."""
    if d.world_size == 1:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def first_problem(problem, d):
    """The first rank's problem (a string, or None for none) on every rank, so that all raise alike (collective)."""
    return problem if d.world_size == 1 else _first_of_ranks(problem, d)


def _first_of_ranks(problem, d):
    problems = [None] * d.world_size
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def full_tensor(x):
    """A DTensor's full value (a collective); a plain tensor as it is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


# ----------------------------------------------------------------------------- one run per out_dir
#
# out_dir/.lock          rank 0 holds it exclusively for the run's life; it names the holder (pid, host, start)
# out_dir/.lock.workers  every rank holds it shared for the run's life
# flock is advisory: it keeps out runs that ask, nothing else. Over NFS Linux turns it into byte-range locks
# that every client sees, so ranks on several nodes sharing out_dir are covered; a filesystem with no lock
# support at all raises OSError from lock_out_dir.

LOCK, WORKERS_LOCK = ".lock", ".lock.workers"


class OutDirBusy(RuntimeError):
    """out_dir is in use by another run, or by processes left over from one."""


class EveryRank(SystemExit):
    """A refusal every rank meets alike: it follows from the command line and out_dir alone, or was told to every
    rank. Under torchrun rank 0 says it and the others leave quietly (train.py), so that it is said once."""


class OutDirLock:
    """The open lock files; the OS drops the locks when they close or the process dies (SIGKILL included)."""

    def __init__(self, files):
        self.files = files

    def release(self):
        for f in self.files:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _try_flock(f, kind):
    try:
        fcntl.flock(f, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def lock_out_dir(out_dir, d):
    """Make this run the only one using out_dir (collective); OutDirBusy on every rank when another is.

    Keep the returned OutDirLock for the run's life. Two files because a
    launcher can die and leave its workers running, each still writing:
    rank 0's exclusive `.lock` keeps two launches apart, and the shared lock
    every rank holds on `.lock.workers` lets a new rank 0, probing it
    exclusively before its own ranks take it, see workers left from any
    earlier launch, whatever that launch's world size. No rank starts writing
    before all agree.
    """
    os.makedirs(out_dir, exist_ok=True)
    held, problem = [], None
    if d.master:
        main = open(os.path.join(out_dir, LOCK), "a+")
        held.append(main)
        main.seek(0)
        previous = main.read().strip() or "holder unknown"  # read at once: a free lock is rewritten below
        if not _try_flock(main, fcntl.LOCK_EX):
            problem = f"is in use by another run ({previous}); wait for it to finish or use another --out_dir"
        else:
            with open(os.path.join(out_dir, WORKERS_LOCK), "a") as probe:
                if not _try_flock(probe, fcntl.LOCK_EX):
                    problem = (f"is in use by processes left from an earlier run whose rank 0 ({previous}) has "
                               "exited (its launcher killed?); stop them or use another --out_dir")
        if problem is None:
            since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            main.truncate(0)
            main.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {since}\n")
            main.flush()
    problem = first_problem(problem, d)  # rank 0's probe is over before any rank takes the shared lock
    if problem is None:
        workers = open(os.path.join(out_dir, WORKERS_LOCK), "a")
        held.append(workers)
        if not _try_flock(workers, fcntl.LOCK_SH):  # only another launch's probe, at this very moment
            problem = f"is being claimed by another run (seen by rank {d.rank}); use another --out_dir"
        problem = first_problem(problem, d)
    if problem is not None:
        OutDirLock(held).release()
        raise OutDirBusy(f"out_dir {out_dir} {problem}")
    return OutDirLock(held)


# ----------------------------------------------------------------------------- checkpoints
#
# out_dir/checkpoints/step_00000004/
#     __0_0.distcp ... .metadata    model and optimizer, and a reference that training updates (sync_ref_model),
#                                    torch.distributed.checkpoint (any world size loads them)
#     trainer.pt                     step, LR schedule, wandb run id (rank 0)
#     rng_<rank>.pt                  torch / CUDA / Python random states of each rank
#     manifest.json                  written last: file names and sizes; a folder without it is not a checkpoint
# A checkpoint is written into .tmp_step_... and renamed when complete.

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"


def checkpoint_dirs(out_dir):
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


def first_non_finite(model):
    """The name of the first parameter holding a NaN or inf in this rank's shard, else None (one host sync)."""
    named = [(n, p.to_local() if hasattr(p, "to_local") else p) for n, p in model.named_parameters()]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in named]).tolist()
    return next((n for (n, _), ok in zip(named, finite) if not ok), None)


def save_checkpoint(out_dir, step, model, optimizer, trainer_state, d, keep=2, ref=None):
    """Write a complete checkpoint for `step` (collective: every rank calls it); keep the newest `keep`.

    `ref`: a second model saved with them, where its weights are state too (a reference that sync_ref_model
    updates); sharded as `model` is.

    RuntimeError on every rank, before anything is written or removed, when a parameter is not finite:
    such a checkpoint would replace the good ones it rotates out. disk.WriteError on every rank when a write
    fails for the storage's sake (a full disk, a quota, ...): the partial checkpoint is removed (it would keep
    the disk full) and the earlier ones are left as they were.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    for m in (model, ref) if ref is not None else (model,):
        free_gathered(m)  # the check below must see the shards, not the root group's gathered copies
    bad = first_non_finite(model)
    problem = first_problem(bad and f"parameter {bad.removeprefix('lm.')} holds NaN or inf on rank {d.rank}", d)
    if problem is not None:
        raise RuntimeError(f"save_checkpoint: {problem} at step {step}; nothing saved, the checkpoints in "
                           f"{os.path.join(out_dir, CHECKPOINTS)} are left as they were")
    final = os.path.join(out_dir, CHECKPOINTS, f"step_{step:08d}")
    tmp = os.path.join(out_dir, CHECKPOINTS, f".tmp_step_{step:08d}")
    # A write that fails for the storage's sake (a full disk, ...) is (cause, errno) on the rank that met it;
    # the ranks agree on it where they used to only wait for each other, so all stop alike.
    failed = None
    if d.master:
        try:
            for stale in glob.glob(os.path.join(out_dir, CHECKPOINTS, ".tmp_step_*")):  # left by an earlier run
                shutil.rmtree(stale, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            failed = disk.write_failure(e, tmp) or (e.strerror or str(e), e.errno)
    failed = first_problem(failed, d)
    if failed is None:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        if ref is not None:
            state["ref"] = get_model_state_dict(ref)
        try:
            with warnings.catch_warnings():  # one process: DCP warns that it saves without a process group, as asked
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(state, checkpoint_id=tmp, no_dist=d.world_size == 1)
            torch.save(_rng_state(), os.path.join(tmp, f"rng_{d.rank}.pt"))
            if d.master:
                torch.save({**trainer_state, "step": step, "world_size": d.world_size}, os.path.join(tmp, "trainer.pt"))
        except BaseException as e:  # DCP reports a Ctrl-C in its writers as its own error: let it be one again
            if any(isinstance(f, KeyboardInterrupt) for f in _rank_errors(e)):
                raise KeyboardInterrupt from e
            failed = disk.write_failure(e, tmp)  # measured now, before anything is removed
            if failed is None:
                raise
        failed = first_problem(failed, d)  # also: every rank's files are written
    if failed is None and d.master:
        try:
            files = {f: os.path.getsize(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))}
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump({"step": step, "world_size": d.world_size, "files": files}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            failed = disk.write_failure(e, tmp) or (e.strerror or str(e), e.errno)
        if failed is None:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in checkpoint_dirs(out_dir)[max(1, keep):]:  # only once the new one is complete
                shutil.rmtree(old, ignore_errors=True)
    failed = first_problem(failed, d)
    if failed is not None:
        if d.master:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier(d)
        earlier = checkpoint_dirs(out_dir)  # rotated out only after a complete save
        reason, code = failed
        raise disk.WriteError(f"cannot write the checkpoint of step {step} to {tmp}: {reason}; the partial checkpoint "
                              f"was removed" + (", the earlier ones are intact" if earlier else ""), tmp, code)
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


def _rank_errors(e):
    """The errors behind a CheckpointException, first rank first (its `failures`: rank -> error, or
    (error, traceback summary)); none for any other exception."""
    failures = getattr(e, "failures", None) or {}
    return [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items(), key=lambda kv: kv[0])]


def _load_failure(e):
    """One line saying why a load failed; for a CheckpointException, its first failing rank's own error.

    CheckpointException's own text begins `CheckpointException ranks:dict_keys([0])`, then tracebacks.
    """
    e = next(iter(_rank_errors(e)), e)
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _saved_names(path):
    """The names of the tensors (and other entries) a DCP checkpoint holds, from its metadata."""
    import torch.distributed.checkpoint as dcp
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata.keys()


def load_latest_checkpoint(out_dir, model, optimizer, d, ref=None):
    """Load the newest complete checkpoint in out_dir into model and optimizer (collective); also into `ref`
    when given (save_checkpoint's `ref`: a checkpoint saved without one is skipped).

    Returns the trainer state saved with it (step, LR schedule, wandb id, ...),
    or None when there is none. A damaged or incomplete checkpoint is skipped
    with a line naming it (rank 0 prints it); the one before it is tried. Loading goes into a
    copy first and reaches the model only once every tensor was read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException  # a BaseException: not caught by `except Exception`
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    paths = checkpoint_dirs(out_dir)
    paths = broadcast_object(paths, d)  # rank 0's listing for all: ranks that saw other files would diverge
    skipped = []
    for path in paths:
        problem = _check_manifest(path)
        # agree on the manifest verdict before dcp.load, itself a collective
        if all_reduce_sum([float(problem is not None)], d)[0]:
            problem = problem or "incomplete on another rank"
        if problem is None:
            try:
                if ref is not None and not any(k.startswith("ref.") for k in _saved_names(path)):
                    raise LookupError("no reference model in it (saved by a run without sync_ref_model)")
                state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
                if ref is not None:  # saved only where asked for (save_checkpoint's `ref`)
                    state["ref"] = get_model_state_dict(ref)
                state = _copy_state(state)
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.load(state, checkpoint_id=path, no_dist=d.world_size == 1)
                trainer_state = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
                rng_file = os.path.join(path, f"rng_{d.rank}.pt")
                rng = torch.load(rng_file, weights_only=False) if os.path.exists(rng_file) else None
            except (Exception, CheckpointException) as e:  # any failure to read means: not this one
                problem = _load_failure(e)
        # every rank must pick the same checkpoint, and can say why another rank could not load it
        problem = first_problem(problem, d)
        if problem is not None:
            if d.master:  # the trainer's own line, not Python's warning format (which names this file and line)
                print(f"warning: skipping checkpoint {path}: {problem}", flush=True)
            skipped.append(f"{path}: {problem}")
            continue
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        if ref is not None:
            set_model_state_dict(ref, state["ref"])
        if rng is not None:
            _set_rng_state(rng)
        trainer_state["path"] = path
        return trainer_state
    optimizer.state.clear()  # get_optimizer_state_dict initialised AdamW's state: a fresh start has none
    if skipped:
        # starting over would overwrite this run's checkpoints and metrics: stop and say why instead
        raise EveryRank(f"out_dir {out_dir} holds checkpoints but none fits this model (saved from another "
                         "model or config, or damaged):\n  " + "\n  ".join(skipped) +
                         "\nUse another --out_dir to start a new run, or remove these folders.")
    return None


# ----------------------------------------------------------------------------- export


GATHER_PIECE_BYTES = 64 << 20  # what one gather of the export moves from all ranks together


def full_host_tensor(x):
    """A tensor's full value in host memory on rank 0, None on the other ranks (a collective: every rank calls it,
    for the same tensors in the same order); a plain tensor, on the host. The export gathers the model with it one
    tensor at a time (runs/export.py).

    A DTensor sharded along dim 0 (FSDP2's layout) is gathered to rank 0 alone, a few rows of every rank's shard
    at a time (GATHER_PIECE_BYTES together), straight into the whole tensor: rank 0 holds the tensor plus one piece,
    the other ranks nothing more than their shards. DTensor's full_tensor() would all-gather the tensor into every
    rank, and gloo copies a collective's output through a buffer of its own: twice the tensor on every rank."""
    if not hasattr(x, "full_tensor"):
        return x.detach().cpu()
    mesh = dim0_mesh(x)
    if mesh is None:
        whole = x.full_tensor().cpu()
        return whole if dist.get_rank() == 0 else None
    if x.device_mesh.ndim == 2 and x.device_mesh.get_local_rank("replicate") != 0:
        return None  # HSDP: the first replica's ranks hold every row; the other replicas' copies are not needed
    local, world, first = x.to_local(), mesh.size(), mesh.get_local_rank() == 0
    if local.device.type != mesh.device_type:  # shards kept on the host (--cpu_offload): NCCL gathers on GPUs
        local = local.to(mesh.device_type)
    rows = -(-x.shape[0] // world)  # each rank's rows, the last ones' padded: Shard(0) cuts as torch.chunk does
    row_bytes = max(1, math.prod(x.shape[1:]) * x.element_size())
    step = max(1, GATHER_PIECE_BYTES // world // row_bytes)
    whole = torch.empty((world * rows, *x.shape[1:]), dtype=x.dtype) if first else None
    for i in range(0, rows, step):
        n = min(step, rows - i)
        piece = torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=local.device)
        piece[:max(0, min(n, local.shape[0] - i))] = local[i:i + n]
        got = [torch.empty_like(piece) for _ in range(world)] if first else None
        dist.gather(piece, got, group_dst=0, group=mesh.get_group())
        if first:
            for r, part in enumerate(got):
                whole[r * rows + i:r * rows + i + n] = part
    return whole[:x.shape[0]] if first else None
