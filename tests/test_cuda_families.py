"""The families' fast paths on CUDA (skipped without it): CUDA graphs, grouped expert matmuls and recurrent states.

On a CPU the decode body CUDA graphs capture is checked against the eager one
(test_static_families.py); here the graphs themselves run. Per family, float32
(TF32 off, so the references are float32 too): graph and eager rollouts sample
the same tokens, over several turns with answers appended and with compaction
across cache spans, and the sampler's log-probs equal one plain forward of each
row's trajectory. The model's own forward, our loop around it, is checked the
same way for the families that take it.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import architectures  # noqa: E402
import sampling  # noqa: E402
from layers import transformer  # noqa: E402
from layers import static_moe  # noqa: E402
from test_fast_paths import assert_same_rollout, prompts, run  # noqa: E402
from test_multiturn import multi_turn  # noqa: E402
from test_static_families import CASES, build, per_row_logprobs  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def float32_everywhere():
    """TF32 off for matmuls and convolutions (Qwen3.5's), so that both sides compute in float32."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def on_cuda(case, **kw):
    model, tok = build(case, **kw)
    return model.to("cuda"), tok


@pytest.mark.parametrize("case", CASES)
def test_cuda_graph_multi_turn_equals_eager_and_each_row_forward(case):
    model, tok = on_cuda(case)
    assert transformer.decide(model).samples_written_out()
    enc = prompts(tok, "cuda")
    seeds = torch.arange(6, device="cuda") * 7 + 3
    eager = multi_turn(model, tok, enc, cuda_graph=False, seeds=seeds)
    graph = multi_turn(model, tok, enc, cuda_graph=True, seeds=seeds, keep_decoder=True)
    assert model._static_decoder.graphs.captured, "no CUDA graph was captured"
    assert (graph.turns > 1).any()
    assert_same_rollout(graph, eager, logp_atol=1e-4)
    pol = graph.policy_mask.bool()
    want = per_row_logprobs(model, enc, graph)
    torch.testing.assert_close(graph.logprobs[pol], want[pol], atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_cuda_graph_spans_and_compaction_equal_eager(case):
    """Long completions cross several cache spans (one graph each) while rows finish and the batch shrinks."""
    model, tok = on_cuda(case)
    enc = prompts(tok, "cuda")
    kw = dict(seeds=torch.arange(6, device="cuda") * 5 + 1, max_new_tokens=200, eos_ids=[97, 98, 99])
    eager = run(model, tok, enc, cuda_graph=False, **kw)
    graph = run(model, tok, enc, cuda_graph=True, **kw)
    assert len({span for _, span in model._static_decoder.graphs.captured}) >= 2
    assert_same_rollout(graph, eager, logp_atol=1e-4)
    want = per_row_logprobs(model, enc, graph)
    torch.testing.assert_close(graph.logprobs, want * graph.completion_mask, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["gemma2", "qwen3_5", "gpt_oss"])
def test_cuda_model_forward_multi_turn_equals_each_row_forward(case, monkeypatch):
    """Our loop on the model's own forward (forced onto it), several turns."""
    model, tok = on_cuda(case)
    architectures.force_model_forward(monkeypatch)
    enc = prompts(tok, "cuda")
    r = multi_turn(model, tok, enc, seeds=torch.arange(6, device="cuda") * 7 + 3)
    assert (r.turns > 1).any()
    pol = r.policy_mask.bool()
    want = per_row_logprobs(model, enc, r)
    torch.testing.assert_close(r.logprobs[pol], want[pol], atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_grouped_expert_matmuls_equal_the_model_block(case, dtype):
    """static_moe.MoE on CUDA (grouped_mm in bf16), with LoRA on the experts, against the block's own forward."""
    model, _ = build(case)
    architectures.adapt(model, 8, "experts.gate_up_proj,experts.down_proj")
    g = torch.Generator().manual_seed(1)
    model = model.to("cuda", dtype)
    h = (torch.randn(2, 37, model.config.hidden_size, generator=g) * 2).to("cuda", dtype)
    blocks = [layer.mlp for layer in model.model.layers if transformer.is_moe(layer.mlp)]
    for mlp in blocks:
        moe = static_moe.MoE(mlp)
        assert moe.grouped == (dtype == torch.bfloat16)  # float32: the gather-and-bmm stand-in, capturable
        with torch.no_grad():
            got, experts = moe(h.view(-1, h.shape[-1]))
            want = mlp(h)
            want = want[0] if isinstance(want, tuple) else want
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.view(h.shape).float(), want.float(), atol=tol * want.abs().max().item(), rtol=0)
        if dtype == torch.float32:
            _, _, want_experts = (getattr(mlp, "gate", None) or mlp.router)(h.view(-1, h.shape[-1]))
            assert torch.equal(experts, want_experts)
