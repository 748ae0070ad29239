"""The memory plan (runs/plan.py, `train.py --plan`) against the real objects at small scale, on CPU.

What can be counted is exact: the policy's parameters, gradients and AdamW states after a real optimizer step, the
reference's parameters, the sampler's KV cache, recurrent states and weight copies against a real StaticDecoder.
What is estimated (activations, the log-prob head's buffers) is within 15% of what autograd keeps for a real
micro-batch, measured as the bytes of the tensors saved for backward. The advice names a setting that, applied,
makes the plan fit, and the plan reads a model's config alone: never its weights, never a download.

The table of docs/memory.md: `python -m runs.plan` (runs.plan.SHAPES holds the models' published shapes).
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from config import Config
from runs import plan
from layers.engine import StaticDecoder
import logprobs
import model_loading
from runs.setup import make_optimizer
import architectures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _real(config, lora_rank=0):
    torch.manual_seed(0)
    model = model_loading.causal_lm_class(config).from_config(config, dtype=torch.float32)
    if lora_rank:
        from layers import lora
        lora.add_lora(model, lora_rank, 32.0, "all")
    return model


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


@pytest.mark.parametrize("family,lora_rank", [("qwen2", 0), ("qwen3", 4), ("qwen3_moe", 0)])
def test_state_bytes_equal_the_tensors_after_one_optimizer_step(family, lora_rank):
    tok = model_loading.build_byte_tokenizer()
    config = architectures.config(family, tok)
    cfg = Config(lora_rank=lora_rank, beta=0.04, device="cpu")
    model = _real(config, lora_rank)
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
    model(input_ids=torch.randint(0, 200, (2, 9))).logits.float().pow(2).mean().backward()
    optimizer.step()
    ref = model_loading.build_reference_model(model, 0 if lora_rank else cfg.beta)
    p = plan.plan(cfg, config, world=1, device="cpu", gpu_gib=8, host_gib=8)
    parts = dict(p.phase("training").parts)
    trained = [q for q in model.parameters() if q.requires_grad]
    states = [s for q in trained for s in optimizer.state[q].values()]
    assert parts["policy parameters"] == _bytes(model.parameters())
    assert parts["gradients"] == _bytes([q.grad for q in trained])
    assert parts["AdamW moments"] + parts["AdamW steps"] == _bytes(states)
    assert parts.get("reference parameters", 0) == (_bytes(ref.parameters()) if ref is not None else 0)
    assert p.params == sum(q.numel() for q in {id(q): q for q in model.parameters()}.values())


def test_shards_are_what_fully_shard_holds_per_rank():
    """dim 0 split over W ranks in chunks of ceil(dim0 / W) rows: a rank's padded shard, as FSDP2 allocates it."""
    t = torch.empty(10, 3, device="meta")
    assert plan.shard_numel(t, 4) == 3 * 3 and plan.shard_numel(t, 1) == 30 and plan.shard_numel(t, 10) == 3


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5", "gpt_oss", "gemma3"])
def test_kv_cache_and_weight_copies_equal_a_real_transformer(family):
    """The generation phase's decoder parts against StaticDecoder built for the same rows and length, on real
    weights; the KV cache also against its formula (every attention layer, windowed ones too, holds all slots)."""
    tok = model_loading.build_byte_tokenizer()
    config = architectures.config(family, tok)
    cfg = Config(prompts_per_step=3, num_generations=2, max_prompt_length=20, max_completion_length=50,
                 device="cpu")
    p = plan.plan(cfg, config, world=1, device="cpu", gpu_gib=8, host_gib=8)
    parts = dict(p.phase("generation").parts)
    model = _real(config)
    rows, length = 6, 20 + 50 + 1
    dec = StaticDecoder.for_model(model, rows, length, cuda_graph=False)
    real = plan.decoder_bytes(dec)
    for part in ("weight copies", "KV cache", "recurrent states", "per-row tables"):
        assert parts[part] == real[part], part
    attention = sum(t != "linear_attention" for t in (getattr(config, "layer_types", None) or
                                                       ["full_attention"] * config.num_hidden_layers))
    slots = 128  # 71 tokens, rounded up to 64-slot steps
    assert parts["KV cache"] == 2 * attention * rows * config.num_key_value_heads * slots * config.head_dim * 4
    if family == "qwen2":  # no norm tables: the fused copies are the model's parameters once each
        assert parts["weight copies"] == _bytes(model.parameters())


def test_a_stream_holds_its_decoder_through_the_training_step():
    """--max_staleness: the stream's places (every step's rows it decodes at once) are the decoder's rows, and its
    weight copies and cache stay alive through the training step, on top of what a synchronous step holds there:
    exactly the decoder of a real StaticDecoder of that many rows."""
    tok = model_loading.build_byte_tokenizer()
    config = architectures.config("qwen3", tok)
    cfg = Config(prompts_per_step=3, num_generations=2, max_prompt_length=20, max_completion_length=50, device="cpu")
    sync = plan.plan(cfg, config, world=1, device="cpu", gpu_gib=8, host_gib=8)
    ahead = plan.plan(dataclasses.replace(cfg, max_staleness=2), config, world=1, device="cpu", gpu_gib=8, host_gib=8)
    real = plan.decoder_bytes(StaticDecoder.for_model(_real(config), 6 * 3, 20 + 50 + 1, cuda_graph=False))
    assert dict(ahead.phase("generation").parts)["KV cache"] == real["KV cache"]
    extra = {k: v for k, v in ahead.phase("training").parts if k not in dict(sync.phase("training").parts)}
    assert extra == {f"{k} (kept through the step: --max_staleness)": v for k, v in real.items()}


def test_a_stream_on_the_models_own_forward_holds_its_cache_through_the_training_step():
    """The same where the sampler takes the model's own forward (Qwen3-MoE with its experts sharded over 2
    processes): the stream's KV cache, every attention layer's K and V for each of the 3 steps' rows on this process
    over the whole length, stays alive through the training step."""
    tok = model_loading.build_byte_tokenizer()
    config = architectures.config("qwen3_moe", tok)
    cfg = Config(prompts_per_step=3, num_generations=2, max_prompt_length=20, max_completion_length=50, device="cpu")
    sync = plan.plan(cfg, config, world=2, device="cpu", gpu_gib=8, host_gib=8)
    ahead = plan.plan(dataclasses.replace(cfg, max_staleness=2), config, world=2, device="cpu", gpu_gib=8, host_gib=8)
    generation = dict(ahead.phase("generation").parts)
    assert "blocks gathered (model's own forward)" in generation
    rows = 3 * 2 // 2 * 3
    kv = 2 * config.num_hidden_layers * rows * (20 + 50 + 1) * config.num_key_value_heads * config.head_dim * 4
    assert generation["KV cache"] == kv
    extra = {k: v for k, v in ahead.phase("training").parts if k not in dict(sync.phase("training").parts)}
    assert extra == {"KV cache (kept through the step: --max_staleness)": kv}


@pytest.mark.parametrize("checkpointing,shared,family", [(False, False, "qwen3"), (True, False, "qwen3"),
                                                         (False, True, "qwen3"), (False, True, "qwen3_moe")])
def test_training_total_is_within_15_percent_of_the_tensors_alive(checkpointing, shared, family):
    """One process, float32 on CPU, a micro-batch of 8 rows of 64 + 192 positions: the plan's training total (the
    policy's state, the reference, activations, the log-prob head) against the real state's bytes plus the bytes
    autograd keeps for backward over the micro-batch's forward and head (completion_logprobs). With shared_prompts
    the rows are 4 groups of 2 and the forward runs each prompt once (4 x 64 + 8 x 192 positions): on the
    written-out layers (Qwen3), and on the model's own forward with a tree mask (Qwen3-MoE)."""
    tok = model_loading.build_byte_tokenizer()
    config = architectures.config(family, tok, num_hidden_layers=4, hidden_size=128, intermediate_size=256,
                                  head_dim=32)
    cfg = Config(prompts_per_step=4, num_generations=2, micro_batch_size=8, max_prompt_length=64,
                 max_completion_length=192, gradient_checkpointing=checkpointing, beta=0.04, device="cpu",
                 shared_prompts=shared)
    p = plan.plan(cfg, config, world=1, device="cpu", gpu_gib=8, host_gib=8)
    model = _real(config)
    if checkpointing:
        model_loading.enable_checkpointing(model)
    model.train()
    ref = model_loading.build_reference_model(model, cfg.beta)
    optimizer = make_optimizer(model.parameters(), cfg)
    ids = torch.randint(3, 250, (8, 64 + 192))
    ids[1::2, :64] = ids[::2, :64]  # 4 groups of 2 rows, each group's rows one prompt
    mask = torch.ones_like(ids)
    params = {q.untyped_storage().data_ptr() for q in model.parameters()}
    (mb,) = (logprobs.shared_micro_batches(mask, torch.ones(8, 192), 192, 8, prompt_ids=ids[:, :64]) if shared
             else logprobs.micro_batches(mask, torch.ones(8, 192), 192, 8))

    def forward():
        return logprobs.completion_logprobs(model, *mb.take(ids, mask), mb.t, width=mb.width)[0]
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = forward()
    saved = sum(seen.values())
    logp.mean().backward()
    optimizer.step()
    state = (_bytes(model.parameters()) + _bytes([q.grad for q in model.parameters()]) + _bytes(
        [s for q in model.parameters() for s in optimizer.state[q].values()]) + _bytes(ref.parameters()))
    measured = state + saved
    parts = p.phase("training").parts
    # what lives only while backward runs (a recomputed layer, the head's chunk buffers) is not in `saved`
    transient = sum(b for label, b in parts if label.startswith(("one layer recomputed", "log-prob head: a chunk")))
    planned = p.phase("training").total - (transient if checkpointing else 0)
    assert abs(planned - measured) / measured < 0.15, (planned, measured, saved)
    estimated = sum(b for label, b in parts if label.startswith(("activations", "log-prob head: kept")))
    assert abs(estimated - saved) / saved < 0.15, (estimated, saved)


def test_the_advice_names_a_setting_that_makes_it_fit():
    """Qwen3-8B's shape, 8 GPUs, 16k completions for 512 rows: the KV cache alone does not fit; the advice's setting,
    applied, makes the plan fit."""
    config = plan.shape_config("Qwen3-8B")
    cfg = Config(prompts_per_step=64, num_generations=8, max_completion_length=16384, micro_batch_size=1,
                 gradient_checkpointing=True)
    limits = dict(gpu_gib=80, host_gib=2048)
    p = plan.advise(cfg, config, plan.plan(cfg, config, 8, "cuda", **limits), **limits)
    assert [ph.name for ph, _ in p.over()] == ["generation"]
    assert "--generation_batch_size=" in p.advice[0]
    change, world = p.fix
    fixed = plan.plan(dataclasses.replace(cfg, **change), config, world, "cuda", **limits)
    assert not fixed.over()


STREAM_8B = dict(prompts_per_step=32, num_generations=16, max_completion_length=16384, micro_batch_size=1,
                 gradient_checkpointing=True, model_init_kwargs={"dtype": "bfloat16"})


@pytest.mark.parametrize("streaming", [dict(max_staleness=1), dict(rollouts_in_flight=64)])
def test_under_streaming_the_advice_is_fewer_places_never_a_batch_size(streaming):
    """Qwen3-8B's shape at 16k, 8 GPUs, streaming: the stream's places are the rows decoding at once, so the advice
    is a smaller --rollouts_in_flight (which fits alone, on these 8 GPUs), never --generation_batch_size (void under
    streaming, refused with it) nor more GPUs; applied, the plan fits. The report says the rows decoding at once
    and the KV cache per token: 36 layers x 8 K/V heads x 128 dims x (K and V) x 2 bytes = 144 KiB."""
    config = plan.shape_config("Qwen3-8B")
    cfg = Config(**STREAM_8B, **streaming)
    limits = dict(gpu_gib=80, host_gib=2048)
    p = plan.advise(cfg, config, plan.plan(cfg, config, 8, "cuda", **limits), **limits)
    assert p.over() and p.advice[0].startswith("fits with any one of: --rollouts_in_flight="), p.advice
    assert "generation_batch_size" not in p.advice[0] and "GPUs" not in p.advice[0]
    change, world = p.fix
    assert world == 8 and list(change) == ["rollouts_in_flight"]
    fixed = dataclasses.replace(cfg, **change)
    assert not plan.plan(fixed, config, 8, "cuda", **limits).over()
    from config import validate
    validate(fixed, 8)  # the advice is a setting the run takes
    text = plan.report(p)
    rows = 64 * 2 if streaming.get("max_staleness") else 64  # 32 x 16 / 8 a step, or its places
    assert f"{rows} rows decode at once per process" in text, text
    assert f"KV cache takes {36 * 8 * 128 * 2 * 2 // 1024} KiB per token" in text, text


def test_the_advice_keeps_the_experiment_where_memory_settings_fit():
    """Qwen3-30B-A3B's shape at 16k with --tp_size=8: LoRA or dropping the reference would fit too, but they train
    another model; the advice is the settings that keep the experiment (full fine-tuning, the KL term), which fit."""
    config = plan.shape_config("Qwen3-30B-A3B")
    cfg = Config(prompts_per_step=32, num_generations=8, max_completion_length=16384, micro_batch_size=1,
                 gradient_checkpointing=True, tp_size=8)
    limits = dict(gpu_gib=80, host_gib=2048)
    p = plan.advise(cfg, config, plan.plan(cfg, config, 8, "cuda", **limits), more_gpus=False, **limits)
    assert p.fix is not None and not set(p.fix[0]) & {"lora_rank", "beta"}, p.advice
    assert "lora" not in p.advice[0] and "beta" not in p.advice[0]
    assert not plan.plan(dataclasses.replace(cfg, **p.fix[0]), config, 8, "cuda", **limits).over()
    # LoRA alone does lower the largest excess: it is left out by choice, not because it would not help
    lora = plan.plan(dataclasses.replace(cfg, lora_rank=16), config, 8, "cuda", **limits)
    bare = plan.plan(cfg, config, 8, "cuda", **limits)
    assert max(b for _, b in lora.over()) < max(b for _, b in bare.over())


def test_a_gpu_keeps_the_stated_headroom():
    """A GPU phase fits only with --plan_gpu_headroom left free: a plan that fills a GPU to within less than it does
    not fit, and fits with the headroom 0; a CPU plan keeps none."""
    config = plan.shape_config("Qwen3-8B")
    cfg = Config(**STREAM_8B, rollouts_in_flight=8)
    biggest = max(ph.total for ph in plan.plan(cfg, config, 8, "cuda").phases if ph.where == "gpu") / plan.GiB
    gib = biggest + 1.0  # 1 GiB to spare, less than the 3 kept
    assert plan.plan(cfg, config, 8, "cuda", gpu_gib=gib).over()
    assert not plan.plan(dataclasses.replace(cfg, plan_gpu_headroom=0), config, 8, "cuda", gpu_gib=gib).over()
    assert not plan.plan(dataclasses.replace(cfg, plan_gpu_headroom=0.9), config, 8, "cuda", gpu_gib=gib).over()
    assert plan.plan(cfg, config, 8, "cpu").headroom == 0
    assert "3.00 GiB of it left free: --plan_gpu_headroom" in plan.report(plan.plan(cfg, config, 8, "cuda"))


def _train_plan(args, env=None):
    run = subprocess.run([sys.executable, "train.py", "--plan", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, **(env or {})})
    return run.returncode, run.stdout + run.stderr


def _plan_here(args, capsys):
    """`train.py --plan` in this process (the folder's config alone: nothing the environment must set first)."""
    import train
    capsys.readouterr()
    train.main(["--plan", *args])
    return capsys.readouterr().out


def test_plan_reads_the_config_alone_never_the_weights(tmp_path, capsys):
    """A folder whose weights file is garbage plans fine (it is never opened), and so does a hub id of which only
    config.json is in the cache, offline (its own process: the hub's settings are read at import); the printed
    advice, typed back in, makes the plan fit."""
    tok = model_loading.build_byte_tokenizer()
    folder = tmp_path / "model"
    folder.mkdir()
    architectures.config("qwen3", tok).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not a weights file")
    # a hub cache holding one snapshot of config.json alone
    snapshot = tmp_path / "hub" / "models--someone--never-fetched" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((folder / "config.json").read_text())
    (tmp_path / "hub" / "models--someone--never-fetched" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--never-fetched" / "refs" / "main").write_text("0" * 40)
    offline = dict(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), TRANSFORMERS_OFFLINE="1")
    small = ["--plan_world_size=2", "--plan_gpu_memory=0.004", "--plan_gpu_headroom=0", "--prompts_per_step=4",
             "--num_generations=4",
             "--max_completion_length=256", "--max_prompt_length=64"]
    out = _plan_here([f"--model={folder}", *small], capsys)
    assert "memory plan" in out and "does not fit: " in out, out
    advice = next(line for line in out.splitlines() if "fits with" in line)
    fix = advice.split(": ", 1)[1].split(", ")[0].split(" ")[0]  # the first setting named
    out = _plan_here([f"--model={folder}", *small, fix], capsys)
    assert "does not fit" not in out, (fix, out)
    assert out.rstrip().splitlines()[-1].startswith("  fits (rows planned at prompts of 64 tokens"), (fix, out)
    code, out = _train_plan(["--model=someone/never-fetched", *small], offline)
    assert code == 0 and "memory plan" in out, out
    code, out = _train_plan(["--model=someone/not-in-the-cache", *small], offline)
    assert code != 0 and "config.json" in out and "Traceback" not in out, out


@pytest.mark.parametrize("name", ["Qwen3-8B", "Qwen3.8-27B"])
def test_docs_table_is_the_plans(name):
    """docs/memory.md's plan table is `python -m runs.plan`'s output (two of its models: the others take longer)."""
    doc = open(os.path.join(ROOT, "docs", "memory.md")).read()
    for line in plan.table(names=(name,)).splitlines()[2:]:
        assert line in doc, line


def test_a_quantized_checkpoint_is_named_and_planned_dequantized(tmp_path):
    """gpt-oss's MXFP4 checkpoint (quantization_config quant_method mxfp4) is planned as the run holds it, its experts
    dequantized, which one note says; any other quantization is refused in one line naming it, as loading does."""
    tok = model_loading.build_byte_tokenizer()
    config = architectures.config("gpt_oss", tok)
    cfg = Config(prompts_per_step=4, num_generations=2, model_init_kwargs={"dtype": "bfloat16"})
    plain = plan.plan(cfg, config, 2, "cuda")
    config.quantization_config = {"quant_method": "mxfp4"}
    quantized = plan.plan(cfg, config, 2, "cuda")
    assert [ph.total for ph in quantized.phases][1:] == [ph.total for ph in plain.phases][1:]
    # the same dequantized shards held, one expert dequantized at a time beside them; the experts read at 4.25 bits
    extra = {k: v for k, v in quantized.phase("loading").parts if k not in dict(plain.phase("loading").parts)}
    assert list(extra) == ["one expert dequantized at a time"]
    experts = [p for n, p in plan.meta_model(config, torch.bfloat16).named_parameters() if ".experts." in n
               and p.dim() == 3]
    expert_bytes = sum(plan.tensor_bytes([p], 2) for p in experts)
    assert plain.read - quantized.read == 2 * (expert_bytes - expert_bytes * 17 // 64)  # policy and reference
    assert [n for n in quantized.notes if n not in plain.notes] == [
        "loading: quantization_config mxfp4: the checkpoint's experts are MXFP4, dequantized as they are read (each "
        f"process its own); counted here dequantized, in bfloat16; each process reads "
        f"{quantized.read / plan.GiB:.1f} GiB of the checkpoint"]
    config.quantization_config = {"quant_method": "fp8"}
    config.save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match=r"^model: quantization_config quant_method 'fp8' is not supported \(") as e:
        plan.run(dataclasses.replace(cfg, model=str(tmp_path), plan_world_size=2))
    assert "\n" not in str(e.value)


def _doc_verdict(name, completion, setting):
    """The "fits today?" cell of docs/memory.md's table for one model, completion length and setting."""
    row = next(line for line in open(os.path.join(ROOT, "docs", "memory.md"))
               if line.startswith(f"| {name} | {completion} | {setting} |"))
    return row.rstrip(" |\n").rsplit(" | ", 1)[1]


def test_the_advice_keeps_the_node_before_more_gpus(tmp_path):
    """Qwen3-30B-A3B at 16k on 8 GPUs, as a researcher types it: two settings together fit the node, so the advice
    is those (the docs table's), not 64 GPUs."""
    import train
    plan.shape_config("Qwen3-30B-A3B").save_pretrained(tmp_path)
    cfg = train.parse_config(["--plan", f"--model={tmp_path}", "--plan_world_size=8", "--max_completion_length=16384",
                              "--prompts_per_step=32", "--micro_batch_size=1", "--gradient_checkpointing=true",
                              "--plan_host_memory=2048"])
    verdict = plan.run(cfg).splitlines()[-1]
    want = _doc_verdict("Qwen3-30B-A3B", "16k", "full, fp32 master").removeprefix("no: ")
    assert want == "fits with all of: --cpu_offload --generation_batch_size=8"
    assert verdict.startswith(f"  {want} (rows planned at prompts of 512 tokens"), verdict


def test_a_cpu_plan_never_advises_more_processes():
    """On a CPU the processes share one machine's memory: the advice is settings, or more memory, never processes."""
    tok = model_loading.build_byte_tokenizer()
    config = architectures.config("qwen3", tok, num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                                  head_dim=64)
    cfg = Config(device="cpu", prompts_per_step=8, num_generations=8, max_prompt_length=64, max_completion_length=64,
                 micro_batch_size=1, gradient_checkpointing=True)
    for gib in (0.02, 0.04, 0.001):  # (before: 16 processes, 4 processes)
        limits = dict(gpu_gib=gib, host_gib=gib)
        p = plan.advise(cfg, config, plan.plan(cfg, config, 1, "cpu", **limits), **limits)
        assert p.over() and "processes" not in p.advice[0] and "plan_world_size" not in p.advice[0], p.advice
    assert p.advice[0].startswith("does not fit with the settings there are") and \
        p.advice[0].endswith("it would take more memory"), p.advice


def test_planning_a_node_from_a_laptop_takes_a_nodes_host_memory(monkeypatch):
    """--plan_world_size=8 from one process: a node's host memory, said beside it; this machine's where the plan is
    for this machine's processes; --plan_host_memory over both."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(plan, "machine_host_gib", lambda: 23.5)
    node = plan.host_memory(Config(plan_world_size=8), 8, "cuda")
    assert node == (plan.NODE_HOST_GIB, "a node's by default, not this machine's: --plan_host_memory sets it")
    assert plan.host_memory(Config(), 1, "cuda") == (23.5, "this machine's: --plan_host_memory sets it")
    assert plan.host_memory(Config(plan_host_memory=512), 8, "cuda") == (512, "--plan_host_memory")
    config = plan.shape_config("Qwen3-8B")
    cfg = Config(max_completion_length=4096, prompts_per_step=32, micro_batch_size=1, gradient_checkpointing=True)
    limits = dict(gpu_gib=80, host_gib=node[0])
    text = plan.report(plan.plan(cfg, config, 8, "cuda", **limits), node[1])
    assert "host per node (8 processes): 2048.00 GiB (a node's by default, not this machine's" in text, text
    assert "does not fit" not in text, text


def test_the_verdict_names_the_prompt_length_it_assumed():
    tok = model_loading.build_byte_tokenizer()
    config = architectures.config("qwen3", tok)
    for limit, verdict in ((8, "fits"), (0.001, "does not fit with the settings there are")):
        cfg = Config(device="cpu", max_prompt_length=16, max_completion_length=32)
        limits = dict(gpu_gib=limit, host_gib=limit)
        text = plan.report(plan.advise(cfg, config, plan.plan(cfg, config, 1, "cpu", **limits), **limits))
        last = text.splitlines()[-1]
        assert last.startswith(f"  {verdict}") and last.endswith(
            "(rows planned at prompts of 16 tokens, --max_prompt_length, and completions of 32)"), last


def test_the_loading_note_names_a_reference_copy_only_where_one_is_made():
    tok = model_loading.build_byte_tokenizer()
    config = architectures.config("qwen3", tok)
    for cfg, world in ((Config(lora_rank=4), 1), (Config(beta=0.0), 1)):
        note = next(n for n in plan.plan(cfg, config, world, "cuda").notes if n.startswith("loading:"))
        assert "reference as a copy" not in note and "no reference copy" in note, note
    # several processes read their own shards, LoRA's too (its adapters added on the meta model): no reference
    parts = dict(plan.plan(Config(lora_rank=4), config, 2, "cuda").phase("loading").parts)
    assert "policy shards" in parts and "reference shards" not in parts and "whole model" not in parts, parts
    note = next(n for n in plan.plan(Config(), config, 1, "cuda").notes if n.startswith("loading:"))
    assert "then the reference as a copy of it" in note, note


def test_a_tp_size_the_sampler_cannot_split_is_said_in_the_plan(tmp_path):
    """OLMo 3 at --tp_size=2: the line the run stops with, then the plan at --tp_size=1; never "fits" with a note
    about a path the run would not take."""
    tok = model_loading.build_byte_tokenizer()
    architectures.config("olmo3", tok).save_pretrained(tmp_path)
    cfg = Config(plan=True, model=str(tmp_path), tp_size=2, plan_world_size=2, plan_host_memory=64)
    first, *rest = plan.run(cfg).splitlines()
    assert first == ("--tp_size: tensor-parallel decoding does not run Olmo3ForCausalLM at --tp_size=2 "
                     "(Olmo3DecoderLayer: q and k norms over the whole projection, which a rank holding some heads "
                     "cannot compute); --tp_size=1 runs it. The plan at --tp_size=1:"), first
    assert not any("model's own forward" in line or "--tp_size=2" in line for line in rest), rest


def tp_table():
    """docs/memory.md's table of the families --tp_size covers: each family of the tests' table (tests/architectures.py),
    asked as the run asks at its start (runs.plan.tp_refusal), at a size its tiny shape divides over."""
    tok = model_loading.build_byte_tokenizer()
    rows, seen = ["| model class | `--tp_size` > 1 |", "| --- | --- |"], set()
    for name in architectures.FAMILIES:
        model = plan.meta_model(architectures.config(name, tok))
        why = plan.tp_refusal(model, 2)
        if (type(model).__name__, why) in seen:  # a family's variants, one row unless they differ
            continue
        seen.add((type(model).__name__, why))
        rows.append(f"| {type(model).__name__} | {'yes' if why is None else 'no: ' + why} |")
    return "\n".join(rows)


def test_docs_table_of_tensor_parallel_families_is_the_codes():
    """The table in docs/memory.md is what the code answers (printed here when it is not)."""
    doc = open(os.path.join(ROOT, "docs", "memory.md")).read()
    table = tp_table()
    assert table in doc, table


def test_more_gpus_are_advised_only_where_no_setting_fits_the_planned_ones():
    """One GPU too small for any setting: the fewest GPUs that fit, with the settings they still need; applied, the
    plan fits."""
    tok = model_loading.build_byte_tokenizer()
    config = architectures.config("qwen3", tok, num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                                  head_dim=64)
    cfg = Config(prompts_per_step=8, num_generations=8, max_prompt_length=64, max_completion_length=64,
                 micro_batch_size=1, gradient_checkpointing=True, plan_gpu_headroom=0)
    limits = dict(gpu_gib=0.006, host_gib=100)
    p = plan.advise(cfg, config, plan.plan(cfg, config, 1, "cuda", **limits), **limits)
    assert p.advice[0].startswith("no setting fits one GPU; 2 GPUs do: --plan_world_size=2, with all of: "), p.advice
    change, world = p.fix
    assert world == 2 and not plan.plan(dataclasses.replace(cfg, **change), config, world, "cuda", **limits).over()


def test_gpt_oss_loads_from_its_mxfp4_checkpoint_about_p_over_w():
    """docs/memory.md's gpt-oss-120b rows load from its published MXFP4 checkpoint: each of 8 processes holds its
    dequantized bfloat16 shards, about an eighth of the model, and reads its own experts' blocks and scales, about a
    quarter of that (the experts at 4.25 bits a value; the rest bfloat16), as the rows say."""
    config = plan.shape_config("gpt-oss-120b")
    cfg = Config(max_completion_length=4096, prompts_per_step=32, micro_batch_size=1, gradient_checkpointing=True,
                 lora_rank=16, model_init_kwargs={"dtype": "bfloat16"})
    p = plan.plan(cfg, config, 8, "cuda")
    whole = plan.tensor_bytes(plan.meta_model(config, torch.bfloat16).parameters())
    assert p.phase("loading").total == pytest.approx(whole / 8, rel=0.02)  # with the adapters, one expert aside
    assert 0.25 < p.read / (whole / 8) < 0.3
    cell = (f"| {p.phase('loading').total / plan.GiB:.0f} GiB (reads {p.read / plan.GiB:.0f} GiB of its MXFP4 "
            f"checkpoint) |")
    rows = [line for line in open(os.path.join(ROOT, "docs", "memory.md")) if line.startswith("| gpt-oss-120b |")]
    assert len(rows) == 4 and all(cell in row for row in rows), (cell, rows)


def test_a_vision_language_model_is_planned_loading_its_own_shards():
    """Several processes read their own shards of a vision-language model too (its vision tower with the root)."""
    import test_vision
    config, _, _ = test_vision.tiny_vl_parts("qwen2_5_vl")
    parts = dict(plan.plan(Config(), config, 2, "cuda").phase("loading").parts)
    assert list(parts) == ["policy shards", "reference shards"], parts
    whole = plan.tensor_bytes(plan.meta_model(config).parameters())
    assert parts["policy shards"] == pytest.approx(whole / 2, rel=0.05)


def _resident_rise(fn):
    """(fn's result, the largest rise of this process's resident memory while it ran, private and file pages)."""
    from bench.common import memory_rise
    return memory_rise(fn, ("RssAnon", "RssFile"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
def test_one_process_loading_holds_what_the_plan_says(tmp_path):
    """One process loads a folder of safetensors weights as a run does (runs/setup.load_models: the whole policy,
    then the reference as a copy): its resident memory rises by the plan's loading figure, within 15%. The policy's
    tensors are the file's pages, mapped (stored as the model holds them, they are read in place; private from the
    optimizer's first write), the reference's private memory. The modules loading imports on first use are imported
    before (the interpreter's, which the plan leaves out). A 22M-parameter Qwen2 shape, 0.17 GiB planned."""
    import sharding
    from runs import setup
    sharding.map_large_host_tensors()  # as train.py: a freed tensor leaves the process, a new one is a new rise
    path = model_loading.write_tiny_model(str(tmp_path / "model"), hidden_size=512, intermediate_size=1408,
                                          num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)
    config = plan.model_config(Config(model=path))
    torch.manual_seed(0)
    model_loading.causal_lm_class(config).from_config(config).save_pretrained(path)  # imports the model's modules
    cfg = Config(model=path, beta=0.04, device="cpu", out_dir=str(tmp_path / "out"), check_model=False)
    one = sharding.Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    (_, policy, ref), rise = _resident_rise(lambda: setup.load_models(cfg, one, "cpu"))
    planned = plan.plan(cfg, config, 1, "cpu").phase("loading")
    assert dict(planned.parts) == {"whole model": _bytes(policy.parameters()),
                                   "reference copy": _bytes(ref.parameters())}
    assert rise == pytest.approx(planned.total, rel=0.15), (rise / 2**20, planned.total / 2**20)


def test_the_export_is_planned_at_the_tensor_it_holds_most_for():
    """The export's plan against a real tensor of a Qwen3-MoE shape: rank 0 holds the largest tensor gathered whole
    (the fused experts' gate and up projections, 16 MiB) beside its gather's pieces; one process on a CPU reads it
    in place and holds its copy in the checkpoint's layout (a matrix per expert: transformers' reverse conversion
    copies gate and up apart), which the plan counts from the meta tensor's conversion: here from a real one's."""
    from transformers.core_model_loading import revert_weight_conversion
    import sharding
    from runs import export
    tok = model_loading.build_byte_tokenizer()
    config = architectures.config("qwen3_moe", tok, hidden_size=256, moe_intermediate_size=256, num_experts=32)
    model = plan.meta_model(config)
    name, meta = max(model.named_parameters(), key=lambda kv: _bytes([kv[1]]))
    largest = torch.zeros(meta.shape)
    own = largest.untyped_storage().data_ptr()
    copies = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for t in revert_weight_conversion(model, {name: largest}).values()}
    copied = sum(b for ptr, b in copies.items() if ptr != own)
    assert copied == _bytes([largest]) == 16 << 20  # the whole tensor copied: gate and up, each apart
    assert export.check_bytes(largest.dtype) < copied  # the NaN check's temporaries, beside it in turn, are less
    one = plan.plan(Config(), config, 1, "cpu").phase("export").parts
    assert one == [("its copy in the checkpoint's layout", copied)], one
    assert _bytes([largest]) // 4 < sharding.GATHER_PIECE_BYTES // 4  # each rank's rows sent at once
    four = plan.plan(Config(), config, 4, "cpu").phase("export").parts
    assert four == [("gathered whole: experts.gate_up_proj", copied),
                    ("gather pieces in flight", 5 * copied // 4)], four


def test_a_hub_id_not_cached_and_no_hub_is_said_without_a_download_attempt(monkeypatch):
    """Offline, a hub id whose config is not cached: one line saying so, and no request that would sit through the
    hub client's retries (the one call made asks the cache alone)."""
    import transformers
    calls = []

    def from_pretrained(path, **kwargs):
        calls.append(kwargs)
        raise OSError("not cached")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.setattr(plan, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(OSError, match="not in the Hugging Face cache, and the hub cannot be reached"):
        plan.model_config(Config(model="someone/never-fetched"))
    assert calls == [{"local_files_only": True}]
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert plan.hub_reachable() is False


def _plan_8b(world, replicas=None, batch=16):
    cfg = Config(max_completion_length=4096, prompts_per_step=64, num_generations=8, micro_batch_size=1,
                 gradient_checkpointing=True, mixed_precision="bf16", generation_batch_size=batch)
    return cfg, plan.plan(cfg, plan.shape_config("Qwen3-8B"), world, replicas=replicas)


def test_a_replica_holds_the_state_of_a_flat_mesh_its_size():
    """HSDP on 32 GPUs as 4 replicas: a process holds the training state of one of 8 flat processes (its replica's
    share), and decodes the rows of one of 32; the report names the mesh."""
    _, hybrid = _plan_8b(32, replicas=4, batch=0)  # every row of a process decodes at once
    _, flat8 = _plan_8b(8, batch=0)
    _, flat32 = _plan_8b(32, batch=0)
    state = ("policy parameters", "gradients", "AdamW moments", "reference parameters")
    parts = {name: dict(p.phase("training").parts) for name, p in (("hybrid", hybrid), ("8", flat8), ("32", flat32))}
    for k in state:
        assert parts["hybrid"][k] == parts["8"][k] > parts["32"][k], k
    kv = {name: dict(p.phase("generation").parts)["KV cache"] for name, p in (("hybrid", hybrid), ("8", flat8),
                                                                                ("32", flat32))}
    assert kv["hybrid"] == kv["32"] == kv["8"] / 4  # 16 rows a process, not 64
    assert dict(hybrid.phase("loading").parts)["policy shards"] == dict(flat8.phase("loading").parts)["policy shards"]
    assert "32 processes as 4 replicas x 8 shards" in plan.report(hybrid).splitlines()[0]


def test_the_default_mesh_is_a_replica_per_node_where_a_node_holds_it():
    """--replicas=0: Qwen3-8B on 4 nodes of 8 GPUs fits a node's GPUs and goes one replica per node; Qwen3-30B-A3B's
    state does not fit 8 GPUs beside the step and stays flat; one node is always flat."""
    cfg, _ = _plan_8b(32)
    limits = dict(gpu_gib=80.0, host_gib=2048.0)
    assert plan.replicas_at(cfg, plan.shape_config("Qwen3-8B"), 32, "cuda", limits) == 4
    assert plan.replicas_at(cfg, plan.shape_config("Qwen3-30B-A3B"), 32, "cuda", limits) == 1
    assert plan.replicas_at(cfg, plan.shape_config("Qwen3-8B"), 8, "cuda", limits) == 1
    assert plan.replicas_at(dataclasses.replace(cfg, replicas=2), plan.shape_config("Qwen3-30B-A3B"), 32, "cuda",
                            limits) == 2


def test_a_row_that_does_not_fit_is_split_by_the_advice():
    """Qwen3-8B on 8 GPUs of 80 GB, checkpointed layers, one row a micro-batch: 64k-token completions fit one GPU's
    training phase, 128k do not and the advice is --cp_size=2 (or --cpu_offload), 256k only --cp_size=4. Split over
    C ranks, a rank's activations are 1/C of the row's (layer inputs kept and one layer recomputed alike), plus the
    all-to-all's buffers."""
    config, limits = plan.shape_config("Qwen3-8B"), dict(gpu_gib=80.0, host_gib=2048.0)

    def at(tokens, **change):
        cfg = Config(max_completion_length=tokens, max_prompt_length=1024, prompts_per_step=8, num_generations=8,
                     micro_batch_size=1, gradient_checkpointing=True, mixed_precision="bf16", rollouts_in_flight=1,
                     **change)
        return cfg, plan.plan(cfg, config, 8, "cuda", **limits)
    assert not at(65536)[1].over()
    for tokens, advice in ((131072, "fits with any one of: --cp_size=2, --cpu_offload"),
                           (262144, "fits with any one of: --cp_size=4")):
        cfg, p = at(tokens)
        assert [ph.name for ph, _ in p.over()] == ["training"]
        assert plan.advise(cfg, config, p, **limits).advice == [advice]
    whole, split = (dict(at(131072, cp_size=c)[1].phase("training").parts) for c in (1, 4))
    kept = [k for k in whole if k.startswith("activations")][0]
    assert split[kept.replace("positions", "positions, 1/4 of them")] == whole[kept] / 4
    assert split["one layer recomputed in backward"] == whole["one layer recomputed in backward"] / 4
    assert 0 < split["all-to-all buffers (heads for positions, and back)"] < whole[kept] / 4


def test_a_layer_that_cannot_be_split_is_said_first_in_the_plan(tmp_path):
    """--plan --cp_size=2 on Qwen3.5 names the Gated DeltaNet layer, then plans at --cp_size=1."""
    import train
    tok = model_loading.build_byte_tokenizer()
    architectures.config("qwen3_5", tok).save_pretrained(tmp_path)
    cfg = train.parse_config(["--plan", f"--model={tmp_path}", "--plan_world_size=2", "--cp_size=2"])
    text = plan.run(cfg)
    assert text.startswith("--cp_size: Qwen3_5GatedDeltaNet carries a recurrent state along the sequence"), text[:300]
    assert "The plan at --cp_size=1:\nmemory plan:" in text
