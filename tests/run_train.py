"""Run train.py's main with a recorder around it, for the multi-process tests.

    torchrun --standalone --nproc_per_node 2 tests/run_train.py --out_dir=... [train.py flags]
    torchrun --standalone --nproc_per_node 2 tests/run_train.py --runs=RUNS.json   # [[flags], [flags], ...]

With --runs, the runs go one after another in the same processes and process group (starting a launch costs
more than a tiny run); rank 0 prints `=== run OUT_DIR` before each, so that a test can split the output.

Records, in out_dir:
  tokens_rank<r>.jsonl   every rollout's sampled token ids on rank r, one line per step (with max_staleness, each
                         step's rows as the stream hands them out)
  after_rank<r>.json     checks on the reference model and the policy once training is done
  logits.pt              (rank 0) the trained policy's logits on a fixed input, to compare with the export
  ref.pt                 (rank 0, with sync_ref_model) the reference's full weights at the end
  sample_rank<r>.json    (several processes) sampling when ranks' completions end at different lengths
  finished_rank<r>       written when all of rank r's work is done: what is left is the teardown and the exit
  paused_rank<r>         (--pause_after_step=K) rank r finished step K and waits to be killed
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import grpo  # noqa: E402
import sampling  # noqa: E402
from features import sampler_options  # noqa: E402
import model_loading  # noqa: E402
import sharding  # noqa: E402
from layers import engine, routing, transformer  # noqa: E402
import train  # noqa: E402
import features.streaming  # noqa: E402
from features.stream_sampler import Stream  # noqa: E402
from launches import export_differs  # noqa: E402
from runs import setup as run_setup  # noqa: E402

LOGITS_INPUT = torch.arange(3, 40).view(1, -1)  # any ids below the tiny vocabulary size
MAX_NEW = 10


def gathered(root):
    """The whole model on rank 0 (None for each tensor elsewhere), each tensor gathered in turn."""
    sharding.free_gathered(root)
    return {k: sharding.full_host_tensor(v) for k, v in root.lm.state_dict().items()}


def count_all_gathers():
    """Wrap the process-group all-gathers FSDP uses (the name differs across torch versions)."""
    calls = [0]
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            original = getattr(dist, name)

            def counted(*args, _original=original, **kwargs):
                calls[0] += 1
                return _original(*args, **kwargs)
            setattr(dist, name, counted)
    return calls


def uneven_sampling(root, d, pad_id):
    """Rank 0's rows all end at their first token (every id is an EOS there), rank 1's never end.

    With the all-reduced stop rule both ranks must run the same number of
    forwards and return, whether StaticDecoder decodes on its copy of the
    gathered weights, the Hugging Face forward runs on weights gathered once
    for the loop, or it all-gathers them again at every forward (where a rank
    that stopped early would leave the other waiting forever).
    """
    vocab = root.config.get_text_config().vocab_size  # a vision-language config holds it in its text config
    eos_ids = list(range(vocab)) if d.rank == 0 else [vocab + 7]
    prompt = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=MAX_NEW, eos_ids=eos_ids, pad_id=pad_id, seeds=torch.arange(3) + 3 * d.rank,
                  check_every=1, all_done=sharding.all_done_fn(d))
    static_supported = root(lambda lm: transformer.decide(lm).samples_written_out())  # on the sharded model, inside the root's forward
    sharding.free_gathered(root)  # start from shards only (the root keeps its weights after a forward)
    calls = count_all_gathers()
    before = calls[0]
    with sharding.gathered(root):  # StaticDecoder: each block gathered once, for its copy
        static = root(sampling.sample, prompt, torch.ones_like(prompt), **kwargs)
    static_calls, before = calls[0] - before, calls[0]
    with sharding.gathered(root):  # the Hugging Face forward, blocks kept gathered for the loop
        gathered = root(sampler_options.sample, prompt, torch.ones_like(prompt), static_cache=False, **kwargs)
    gathered_calls, before = calls[0] - before, calls[0]
    per_forward = root(sampler_options.sample, prompt, torch.ones_like(prompt), static_cache=False, **kwargs)
    sharding.free_gathered(root)
    return {"static_supported": static_supported,
            "lengths": [r.completion_mask.sum(1).tolist() for r in (static, gathered, per_forward)],
            "same_tokens": all(torch.equal(static.completion_ids, r.completion_ids) for r in (gathered, per_forward)),
            "done": (~gathered.truncated).tolist(), "done_static": (~static.truncated).tolist(),
            "all_gathers_static": static_calls, "all_gathers_gathered": gathered_calls,
            "all_gathers_per_forward": calls[0] - before, "fsdp_groups": len(sharding.fsdp_modules(root))}


def pause_often():
    """Every turn calls the environment's only tool (as the empty call does), and a turn ends at any of the
    letters a-h: rows of a random tiny model then take several turns, at different steps on each rank.
    Returns what undoes it."""
    import environments
    original_init, original_parse = environments.Agent.__init__, environments.parse_calls

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.stop_sequences = [[t] for t in range(97, 105)]
    environments.Agent.__init__ = init
    environments.parse_calls = lambda text: [("", {})]

    def undo():
        environments.Agent.__init__, environments.parse_calls = original_init, original_parse
    return undo


def stop_often():
    """A stream's rows also end at any of the letters a-e: rows of a random tiny model then end at lengths from 1
    to the limit, differently on each rank. Returns what undoes it."""
    original = Stream.__init__

    def init(self, places, capacity, prompt_width, max_new_tokens, eos_ids, *args, **kwargs):
        original(self, places, capacity, prompt_width, max_new_tokens, list(eos_ids) + list(range(97, 102)), *args,
                 **kwargs)
    Stream.__init__ = init

    def undo():
        Stream.__init__ = original
    return undo


def pause_after(step, out_dir):
    """After train_step `step` (its update done, nothing of it saved or logged) each rank writes
    paused_rank<r> in out_dir and waits there, to be killed: a run stopped mid-way. Returns what undoes it."""
    original = train.train_step

    def paused(run, at):
        result = original(run, at)
        if at == step:
            open(os.path.join(out_dir, f"paused_rank{run.d.rank}"), "w").close()
            while True:
                time.sleep(1)
        return result
    train.train_step = paused

    def undo():
        train.train_step = original
    return undo


def main(argv):
    undo = lambda: None  # noqa: E731
    pause = [a for a in argv if a.startswith("--pause_after_step=")]
    if pause:
        argv = [a for a in argv if a not in pause]
        undo = pause_after(int(pause[0].split("=")[1]), next(a.split("=", 1)[1] for a in argv
                                                              if a.startswith("--out_dir=")))
    if "--pause_often" in argv:
        argv = [a for a in argv if a != "--pause_often"]
        undo = pause_often()
    if "--stop_often" in argv:
        argv = [a for a in argv if a != "--stop_often"]
        undo = stop_often()
    try:
        run(argv)
    finally:
        undo()


def run(argv):
    out_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("--out_dir="))
    rank = int(os.environ.get("RANK", 0))
    seen = {}

    original_sample, original_check_exact, checking = sampling.sample, sampling.check_exact, [False]

    def record(ids):
        with open(os.path.join(out_dir, f"tokens_rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(ids.tolist()) + "\n")

    def recording_sample(*args, **kwargs):
        rollout = original_sample(*args, **kwargs)
        if not checking[0]:  # the start-up check's few tokens are no step's rollout
            ids, tp = rollout.completion_ids, getattr(args[0], "tp", None)  # the features' Sampler's
            if tp is not None and tp.size > 1:  # a tensor-parallel group's rows: this rank's share, as wide as alone
                n = ids.shape[0] // tp.size
                ids = ids[tp.rank * n:(tp.rank + 1) * n, :int(rollout.completion_mask[tp.rank * n:(tp.rank + 1) * n]
                                                                .sum(1).max())]
            record(ids)
        return rollout

    original_all_reduce, across = dist.all_reduce, [0]

    def counted_all_reduce(tensor, *args, group=None, **kwargs):  # HSDP's all-reduces across the replicas: over a
        ranks = dist.get_process_group_ranks(group) if group is not None else []  # group of ranks not in a row
        across[0] += len(ranks) > 1 and ranks != list(range(ranks[0], ranks[0] + len(ranks)))
        return original_all_reduce(tensor, *args, group=group, **kwargs)
    dist.all_reduce = counted_all_reduce
    original_stream_batch = features.streaming.RolloutStream.batch

    def recording_stream_batch(self, step, round=0):  # max_staleness: a step's rows come out of the stream
        batch = original_stream_batch(self, step, round)
        record(batch.rollout.completion_ids)
        return batch

    def marked_check(*args, **kwargs):
        checking[0] = True
        try:
            return original_check_exact(*args, **kwargs)
        finally:
            checking[0] = False

    original_check = sharding.check_same_placement

    def spying_check(policy, ref):  # train.py calls it once with both models: keep them for the checks below
        seen["policy"], seen["ref"] = policy, ref
        return original_check(policy, ref)

    original_load = run_setup.load_models

    def spying_load(*args, **kwargs):  # a run without a reference (LoRA, beta 0) meets no check_same_placement
        tokenizer, policy, ref = original_load(*args, **kwargs)
        seen.setdefault("policy", policy)
        seen.setdefault("ref", ref)
        return tokenizer, policy, ref

    sampling.sample, sampling.check_exact, sharding.check_same_placement = recording_sample, marked_check, spying_check
    run_setup.load_models = spying_load
    features.streaming.RolloutStream.batch = recording_stream_batch
    original_layer, layer_calls = transformer._layer_on, [0]

    def counting_layer(*args):  # the written-out training forward's layer, sharded or not
        layer_calls[0] += 1
        return original_layer(*args)
    transformer._layer_on = counting_layer
    original_prefill, prefills = engine.StaticDecoder.prefill, [0]

    def counting_prefill(self, *args, **kwargs):  # the sampler on the written-out decoder
        prefills[0] += 1
        return original_prefill(self, *args, **kwargs)
    engine.StaticDecoder.prefill = counting_prefill
    if not any(a.startswith("--out_dir") for a in argv):
        raise SystemExit("run_train.py needs --out_dir")
    d = sharding.setup("cpu")  # train.main sets up the same process group again: a no-op then
    # train.main tears the process group down at its end: keep it for the checks
    teardown, sharding.teardown = sharding.teardown, lambda: None
    try:
        train.main(argv)
    finally:
        sampling.sample, sampling.check_exact, sharding.check_same_placement = original_sample, \
            original_check_exact, original_check
        transformer._layer_on, sharding.teardown = original_layer, teardown
        engine.StaticDecoder.prefill = original_prefill
        features.streaming.RolloutStream.batch, dist.all_reduce = original_stream_batch, original_all_reduce
        run_setup.load_models = original_load

    policy, ref = seen["policy"], seen["ref"]
    # the reference: still the initial weights, on the policy's device and mesh, in eval mode
    cfg = train.parse_config(argv)
    initial_dir = os.path.join(out_dir, "tiny_model_init") if cfg.model == model_loading.TINY else cfg.model
    initial = model_loading.load_model(initial_dir, cfg.model_init_kwargs, "cpu", seed=cfg.seed).state_dict()
    ref_full, policy_full = gathered(ref) if ref is not None else None, gathered(policy)
    report = {}
    if rank == 0:
        # the run's export, gathered a tensor at a time from the shards: exactly the trained weights
        report["export_differs"] = export_differs(os.path.join(out_dir, "model"), policy_full)
        if ref is not None:
            report["ref_unchanged"] = all(torch.equal(ref_full[k], initial[k]) for k in initial)
        if cfg.sync_ref_model:  # the reference training mixed the policy into, to compare across world sizes
            torch.save(ref_full, os.path.join(out_dir, "ref.pt"))
        report["policy_changed"] = any(not torch.equal(policy_full[k], initial[k]) for k in initial)
    if ref is not None:
        report.update({
            "ref_eval": not ref.training,
            "ref_no_grad": not any(p.requires_grad for p in ref.parameters()),
            "same_placement": sharding.placement(ref) == sharding.placement(policy),
            "ref_devices": sorted({str(p.device) for p in ref.parameters()}),
        })
    report.update({
        "policy_devices": sorted({str(p.device) for p in policy.parameters()}),
        "sharded": d.world_size > 1 and all(hasattr(p, "device_mesh") for p in policy.parameters()),
        "written_out_layer_calls": layer_calls[0],
        "written_out_prefills": prefills[0],
        "all_reduces_across_replicas": across[0],
        "fsdp_groups": len(sharding.fsdp_modules(policy)),
    })
    with open(os.path.join(out_dir, f"after_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if routing.attached(policy.lm) is not None:  # routers left replaying the last training forward's choice
        routing.attached(policy.lm).stop()
    with torch.no_grad():
        logits = policy(lambda lm, ids: lm(input_ids=ids).logits, LOGITS_INPUT)
    if rank == 0:
        torch.save(logits.float(), os.path.join(out_dir, "logits.pt"))
    if d.world_size > 1:
        policy.eval()
        with open(os.path.join(out_dir, f"sample_rank{rank}.json"), "w") as f:
            json.dump(uneven_sampling(policy, d, model_loading.build_byte_tokenizer().pad_token_id), f)
    open(os.path.join(out_dir, f"finished_rank{rank}"), "w").close()  # all this rank's work is done


if __name__ == "__main__":
    if sys.argv[1].startswith("--runs="):
        with open(sys.argv[1].split("=", 1)[1]) as f:
            runs = json.load(f)
    else:
        runs = [sys.argv[1:]]
    for argv in runs:
        if int(os.environ.get("RANK", 0)) == 0:
            print("=== run " + next(a.split("=", 1)[1] for a in argv if a.startswith("--out_dir=")), flush=True)
        main(argv)
    sharding.teardown()
