"""Run train.py's main with a recorder around it, for the multi-process tests.

    torchrun --standalone --nproc_per_node 2 tests/run_train.py --out_dir=... [train.py flags]

Records, in out_dir:
  tokens_rank<r>.jsonl   every rollout's sampled token ids on rank r, one line per step
  after_rank<r>.json     checks on the reference model and the policy once training is done
  logits.pt              (rank 0) the trained policy's logits on a fixed input, to compare with the export
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import grpo  # noqa: E402
import model_loading  # noqa: E402
import sharding  # noqa: E402
import train  # noqa: E402

LOGITS_INPUT = torch.arange(3, 40).view(1, -1)  # any ids below the tiny vocabulary size


def main(argv):
    out_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("--out_dir="))
    rank = int(os.environ.get("RANK", 0))
    seen = {}

    original_sample = grpo.sample

    def recording_sample(*args, **kwargs):
        rollout = original_sample(*args, **kwargs)
        with open(os.path.join(out_dir, f"tokens_rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(rollout.completion_ids.tolist()) + "\n")
        return rollout

    original_check = sharding.check_same_placement

    def spying_check(policy, ref):  # train.py calls it once with both models: keep them for the checks below
        seen["policy"], seen["ref"] = policy, ref
        return original_check(policy, ref)

    grpo.sample, sharding.check_same_placement = recording_sample, spying_check
    if not any(a.startswith("--out_dir") for a in argv):
        raise SystemExit("run_train.py needs --out_dir")
    d = sharding.setup("cpu")  # train.main sets up the same process group again: a no-op then
    # train.main tears the process group down at its end: keep it for the checks
    teardown, sharding.teardown = sharding.teardown, lambda: None
    train.main(argv)

    policy, ref = seen["policy"], seen["ref"]
    # the reference: still the initial weights, on the policy's device and mesh, in eval mode
    cfg = train.parse_config(argv)
    initial = model_loading.load_model(os.path.join(out_dir, "tiny_model_init"), cfg.model_init_kwargs, "cpu",
                                       seed=cfg.seed).state_dict()
    ref_full = sharding.full_state_dict(ref)
    policy_full = sharding.full_state_dict(policy)
    report = {"full_state_dict_keys": sorted(policy_full)}  # full tensors land on rank 0 only
    if rank == 0:
        report["ref_unchanged"] = all(torch.equal(ref_full[k], initial[k]) for k in initial)
        report["policy_changed"] = any(not torch.equal(policy_full[k], initial[k]) for k in initial)
    report.update({
        "ref_eval": not ref.training,
        "ref_no_grad": not any(p.requires_grad for p in ref.parameters()),
        "same_placement": sharding.placement(ref) == sharding.placement(policy),
        "ref_devices": sorted({str(p.device) for p in ref.parameters()}),
        "policy_devices": sorted({str(p.device) for p in policy.parameters()}),
        "sharded": d.world_size > 1 and all(hasattr(p, "device_mesh") for p in policy.parameters()),
    })
    with open(os.path.join(out_dir, f"after_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    with torch.no_grad():
        logits = policy(lambda lm, ids: lm(input_ids=ids).logits, LOGITS_INPUT)
    if rank == 0:
        torch.save(logits.float(), os.path.join(out_dir, "logits.pt"))
    teardown()


if __name__ == "__main__":
    main(sys.argv[1:])
