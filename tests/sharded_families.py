"""Run under torchrun (tests/test_static_families.py): the hybrid and MoE families sampled sharded by FSDP2 as
train.py samples them (the sharded root's forward, the blocks kept gathered) give the tokens and log-probs of the
same model whole, and take the path transformer says: written-out layers gathered one block at a time for
Qwen3.5, the model's own forward for MoE blocks (their experts are read in place, so sharded ones stay there).
Prints one line per family: "<rank> <family> <path> ok"."""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import architectures  # noqa: E402
import sampling  # noqa: E402
import sharding  # noqa: E402
from layers import transformer  # noqa: E402

d = sharding.setup("cpu")
for family in sys.argv[1:]:
    model, tok = architectures.tiny(family)
    whole = copy.deepcopy(model)
    enc = tok(["a>", "hello world>", "xyz"], return_tensors="pt", padding=True, add_special_tokens=False)
    kw = dict(max_new_tokens=10, eos_ids=[], pad_id=tok.pad_token_id, seeds=torch.arange(3) + 5)
    want = sampling.sample(whole, enc.input_ids, enc.attention_mask, **kw)
    root = sharding.shard(sharding.Root(model), d, "fp32")
    path = []
    with sharding.gathered(root):
        root(lambda lm: path.append("fast" if transformer.decide(lm).samples_written_out() else "hf"))
        got = root(sampling.sample, enc.input_ids, enc.attention_mask, **kw)
    assert torch.equal(got.completion_ids, want.completion_ids), family
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    sys.stdout.write(f"{d.rank} {family} {path[0]} ok\n")  # one write: two ranks share the pipe
    sys.stdout.flush()
sharding.teardown()
