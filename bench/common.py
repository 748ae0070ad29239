"""The bench's measuring tools: the model shapes it builds, timing that waits for the device, medians of
alternated runs, a model folder with random weights, and the prompts its rows decode."""

import gc
import os
import random
import statistics
import time

import torch

import model_loading

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, vocab_size=151936)
QWEN25_15B = dict(QWEN25_05B, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12)
# config_class: the same fields under another family's config (tiny_config writes a Qwen2Config); tiny-qwen3 is
# the tiny default with Qwen3's layers (a norm over each head of q and k), head_dim spelled out as Qwen3 needs
# Qwen3-0.6B: TRL's ZeroSync GRPO measures its streaming step on it (512-token completions, 8 per prompt)
QWEN3_06B = dict(config_class="Qwen3Config", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, vocab_size=151936)
MODELS = {"tiny": {}, "tiny-qwen3": dict(config_class="Qwen3Config", head_dim=16), "qwen2.5-0.5b": QWEN25_05B,
          "qwen2.5-1.5b": QWEN25_15B, "qwen3-0.6b": QWEN3_06B}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def medians(runs, s, device):
    """{name: median seconds} of each function of `runs` ({name: fn}), after s["warmup"] calls of each; the
    s["reps"] timed calls alternate between them, so a machine's drift touches all alike."""
    for _ in range(s["warmup"]):
        for fn in runs.values():
            fn()
    times = {k: [] for k in runs}
    for _ in range(s["reps"]):
        for k, fn in runs.items():
            times[k].append(timed(fn, device)[0])
    return {k: statistics.median(v) for k, v in times.items()}


def build_model_dir(root, args):
    """A model folder with weights (so TRL and we load identical ones) and the byte-level tokenizer."""
    path = os.path.join(root, "model")
    overrides = dict(MODELS[args.model])
    config_class = overrides.pop("config_class", None)
    model_loading.write_tiny_model(path, **overrides)
    if config_class:
        import transformers
        fields = transformers.AutoConfig.from_pretrained(path).to_diff_dict()
        for key in ("model_type", "transformers_version", "architectures"):  # the class's own
            fields.pop(key, None)
        getattr(transformers, config_class)(**fields).save_pretrained(path)
    model = model_loading.load_model(path, {"dtype": "float32"}, "cpu", seed=0)
    model.save_pretrained(path)
    return path


def load(path, s, device):
    return model_loading.load_model(path, {"dtype": s["dtype"], "attn_implementation": "sdpa"}, device, seed=0)


def letter_prompts(tokenizer, n, length, device):
    rng = random.Random(0)
    text = ["".join(rng.choice("abcdefgh") for _ in range(length - 1)) + ">" for _ in range(n)]
    return tokenizer(text, return_tensors="pt", padding=True, add_special_tokens=False).to(device)


def free(device):
    """Give a finished row's models back before the next row (its peak memory counts from here)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_rise(fn, fields=("RssAnon",)):
    """(fn's result, the largest rise of this process's resident memory while fn ran: the /proc/self/status `fields`
    summed, read every millisecond by a thread), from a start where what earlier code freed was given back."""
    import threading

    import sharding

    def resident():
        with open("/proc/self/status") as f:
            return sum(int(line.split()[1]) * 1024 for line in f if line.startswith(fields))

    sharding.return_host_memory()
    before, top, done = resident(), [0], []

    def watch():
        while not done:
            top[0] = max(top[0], resident())
            time.sleep(0.001)

    thread = threading.Thread(target=watch)
    thread.start()
    try:
        result = fn()
    finally:
        done.append(True)
        thread.join()
    return result, max(top[0], resident()) - before
