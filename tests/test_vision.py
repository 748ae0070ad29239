"""Images in prompts: tiny vision-language models built from configs (no download), float32.

The sampler's log-probs of image prompts, and the training forward's, against one plain forward of the model
with the same pixel values (the model's own forward finds the image tokens and their rotary positions itself);
a group's images processed and run through the vision tower once.
"""

import os

import numpy as np
import pytest
import torch


import logprobs
import model_loading
from layers import lora
import sampling
from features import sampler_options
from features.stream_sampler import Stream
from features import images as images_feature
from layers import vision

pytest.importorskip("PIL")  # the image processors' backend without torchvision

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     "mrope_section": [2, 3, 3]})
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2)
FAMILIES = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", {}, dict(window_size=8, fullatt_block_indexes=[0])),
    "qwen3_vl": ("Qwen3VLConfig", dict(rope_parameters={**TEXT["rope_parameters"], "mrope_interleaved": True}),
                 dict(num_position_embeddings=64, deepstack_visual_indexes=[0])),
    "qwen3_5": ("Qwen3_5Config", dict(num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                                      linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                      layer_types=["linear_attention"] * 3 + ["full_attention"],
                                      rope_parameters={**TEXT["rope_parameters"], "mrope_interleaved": True,
                                                       "partial_rotary_factor": 0.5}),
                dict(num_position_embeddings=64)),
}


def tiny_vl_parts(family, extra_tokens=()):
    """(config, tokenizer, image processor) of a 2-4 layer vision-language model of `family`."""
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    tok = model_loading.build_byte_tokenizer(extra_tokens)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.padding_side = "left"
    cls, text, vis = FAMILIES[family]
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    cfg = getattr(transformers, cls)(
        text_config={**TEXT, **text, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                     "pad_token_id": tok.pad_token_id},
        vision_config={**VISION, **vis}, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], bos_token_id=None,
        tie_word_embeddings=False)
    processor = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                                         max_pixels=24 * 24)
    return cfg, tok, processor


def tiny_vl(family, seed=0):
    """(model, tokenizer, ImageEncoder) of a randomly initialised 2-4 layer vision-language model, eval mode."""
    from transformers import AutoModelForImageTextToText

    cfg, tok, processor = tiny_vl_parts(family)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norms and biases off their initial values, so that a path that forgets one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval(), tok, vision.ImageEncoder.for_model(model, tok, processor)


def picture(seed, size=(16, 12)):
    return (np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8")


PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def image_rows():
    """Three prompts: one image, two images of other sizes, and none; the first prompt twice (one group)."""
    first = {"prompt": f"look {PAD} what?", "images": [picture(1)]}
    return [first, first,
            {"prompt": f"a{PAD}b{PAD}c", "images": [picture(2, (8, 20)), picture(3, (12, 12))]},
            {"prompt": "no image here at all, text", "images": []}]


def plain_logprobs(model, ids, mask, rollout, images):
    """Each policy token's log-prob from one forward of the model over the row alone, pixel values included."""
    out = torch.zeros_like(rollout.logprobs)
    for i in range(ids.shape[0]):
        p = ids[i][mask[i].bool()]
        c = rollout.completion_ids[i][rollout.completion_mask[i].bool()]
        row = torch.cat([p, c])[None]
        extra = vision.plain_inputs(model, row, images.rows([i]))
        logits = model(input_ids=row, **extra).logits[0, len(p) - 1:-1].float()
        out[i, :len(c)] = torch.log_softmax(logits, -1).gather(-1, c[:, None])[:, 0]
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_image_prompts_sampler_and_training_logprobs_match_a_plain_forward(family):
    model, tok, encoder = tiny_vl(family)
    rows = image_rows()
    texts, images = encoder(rows, [r["prompt"] for r in rows])
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc.input_ids, enc.attention_mask
    assert (ids == model.config.image_token_id).sum(1).tolist()[:3] == [
        int(g[:, 1:].prod(-1).sum()) // 4 for g in images.grid[:3]]
    vocab = model.config.get_text_config().vocab_size
    answers = iter([[3, 1, 4], [1], [5, 9], [2, 6, 5], [7, 7]])
    # turns of one token, answers of different lengths, a token sampled past each pause forgotten: decode and
    # extend steps after the image at positions of each row's own
    rollout = sampler_options.sample(model, ids, mask, max_new_tokens=14, eos_ids=range(vocab), pad_id=tok.pad_token_id,
                              seeds=torch.arange(4), check_every=2, max_turns=3, images=images,
                              respond=lambda turns: [next(answers, [7]) for _ in turns])
    want = plain_logprobs(model, ids, mask, rollout, images)
    policy = rollout.policy_mask.bool()
    assert policy.sum() >= 8 and rollout.turns.max() == 3
    assert (rollout.logprobs - want)[policy].abs().max() < 1e-4
    full_ids = torch.cat([ids, rollout.completion_ids], 1)
    full_mask = torch.cat([mask, rollout.completion_mask], 1)
    train, _ = logprobs.completion_logprobs(model, full_ids, full_mask, rollout.completion_ids.shape[1],
                                            forward=images_feature.Forward(logprobs.Forward()),
                                            extras={"images": images})
    assert (train - want)[policy].abs().max() < 1e-4
    # the images matter: without them the same tokens have other log-probs
    blind, _ = logprobs.completion_logprobs(model, full_ids, full_mask, rollout.completion_ids.shape[1])
    assert (blind - want)[:3][policy[:3]].abs().max() > 1e-3


def test_image_prompts_stream_through_places(monkeypatch):
    """Rows with images streaming through 3 places (`sample(in_flight=3)`, and a Stream, --max_staleness's
    sampler, with rows added between runs): a row admitted into a place has its prompt prefilled there with its
    images (their embeddings, rotary grid and text delta), so every row samples what it samples in one batch, and
    its log-probs are those of a plain forward with its pixel values. Qwen3.5: multi-axis rotary attention and
    Gated DeltaNet states beside it."""
    from layers import hf_decoder
    import rollouts
    admitted, prefill_rows = [], hf_decoder.HFDecoder.prefill_rows
    monkeypatch.setattr(hf_decoder.HFDecoder, "prefill_rows", lambda self, rows, *a: (
        admitted.append(a[-1] is not None), prefill_rows(self, rows, *a))[1])
    model, tok, encoder = tiny_vl("qwen3_5")
    rows = image_rows() * 2
    texts, images = encoder(rows, [r["prompt"] for r in rows])
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask, pad = enc.input_ids, enc.attention_mask, tok.pad_token_id
    vocab = model.config.get_text_config().vocab_size
    seeds, stops = torch.arange(8) * 5 + 1, list(range(0, vocab, 4))  # rows end at different steps
    whole = sampler_options.sample(model, ids, mask, max_new_tokens=12, eos_ids=stops, pad_id=pad, seeds=seeds,
                            images=images)
    assert whole.completion_mask.sum(1).unique().numel() > 2
    streamed = sampler_options.sample(model, ids, mask, max_new_tokens=12, eos_ids=stops, pad_id=pad, seeds=seeds,
                               images=images, in_flight=3)
    assert sum(admitted) >= 2  # image prompts took a place after the first prefill
    stream = Stream(3, 8, ids.shape[1] + 3, 12, stops, pad, sampling.Draw(), torch.device("cpu"))
    stream.add(ids[:5], mask[:5], seeds[:5], list(range(5)), images=images.rows(range(5)))
    stream.run(model, [0, 1, 2], 0)
    got = [stream.take([0, 1, 2])]
    stream.add(ids[5:], mask[5:], seeds[5:], list(range(5, 8)), images=images.rows(range(5, 8)))
    stream.run(model, list(range(3, 8)), 1)
    got.append(stream.take(list(range(3, 8))))
    through = rollouts.cat_rollouts(got, pad)
    want = plain_logprobs(model, ids, mask, whole, images)
    for r in (streamed, through):
        for k in ("completion_ids", "completion_mask", "policy_mask"):
            assert torch.equal(getattr(r, k)[:, :whole.completion_ids.shape[1]], getattr(whole, k)), k
        torch.testing.assert_close(r.logprobs[:, :whole.logprobs.shape[1]], whole.logprobs, atol=1e-5, rtol=0)
        policy = whole.policy_mask.bool()
        assert (r.logprobs[:, :want.shape[1]] - want)[policy].abs().max() < 1e-4


def test_a_groups_images_go_through_the_vision_tower_once():
    model, tok, encoder = tiny_vl("qwen2_5_vl")
    rows = image_rows()
    calls = []
    original = encoder.image_processor.__call__
    encoder.image_processor = lambda images, **kw: calls.append(len(images)) or original(images=images, **kw)
    texts, images = encoder(rows, [r["prompt"] for r in rows])
    assert calls == [1, 2]  # the group's two rows share one processing; the row without images needs none
    assert images.pixel_values[0] is images.pixel_values[1]
    seen = []
    model.model.visual.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    feats, _ = vision.features(model, images)
    # one pass over the patches of each distinct prompt's images, the group's features repeated for its rows
    assert seen == [sum(int(g.prod(-1).sum()) for g in images.grid[1:3])]
    tokens = [int(g.prod(-1).sum()) // 4 for g in images.grid]
    assert feats.shape[0] == sum(tokens)
    torch.testing.assert_close(feats[:tokens[0]], feats[tokens[0]:2 * tokens[0]], rtol=0, atol=0)


def test_lora_adapts_the_language_model_only():
    for targets in ("all", "gate_proj"):  # the vision tower's MLPs have a gate_proj too
        m = tiny_vl("qwen2_5_vl")[0]
        assert any(n.endswith("gate_proj") for n, _ in m.model.visual.named_modules())
        adapted = lora.add_lora(m, 4, 8.0, targets)
        assert adapted and all(n.startswith("model.language_model.") for n in adapted), adapted
        assert not any(p.requires_grad for p in m.model.visual.parameters())


def test_shapes_pictures_and_reward():
    import random

    from tasks import shapes
    rows = shapes.prompts(random.Random(0), 20)
    for row in rows:
        picture = row["images"][0]
        # the square fills the inside of its cell: find the cell whose inner 6 x 6 pixels are one colour
        found = []
        for cell in range(shapes.GRID ** 2):
            r, c = divmod(cell, shapes.GRID)
            inner = picture[r * 8 + 1:r * 8 + 7, c * 8 + 1:c * 8 + 7].reshape(-1, 3)
            if (inner != 255).any() and (inner == inner[0]).all():
                found.append(tuple(int(v) for v in inner[0]))
        assert found == [shapes.COLOURS[row["answer"]]]
    assert len({r["answer"] for r in rows}) == 4
    assert shapes.square_colour_reward(None, ["red" * 4, "red blue", "xx"], ["red", "red", "red"]) == [1.0, 0.25, 0.0]


def test_shapes_task_trains_the_table_shows_the_pictures_and_the_export_reads_them(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    import train
    logged = []
    real_log = wandb.Run.log
    monkeypatch.setattr(wandb.Run, "log", lambda self, data, *a, **k: (logged.append(dict(data)),
                                                                       real_log(self, data, *a, **k))[1])
    monkeypatch.delenv("WANDB_MODE", raising=False)
    train.main([f"--out_dir={tmp_path / 'out'}", "--task=shapes", "--wandb_mode=offline", "--num_generations=2",
                "--prompts_per_step=2", "--max_steps=1", "--completions_table_every=1",
                "--print_completions_every=0", "--lora_rank=4"])
    table = next(d["completions"] for d in logged if "completions" in d)
    assert table.columns[:3] == ["prompt", "completion", "image"]
    assert len(table.data) == 4 and all(isinstance(row[2], wandb.Image) for row in table.data)
    # the export reads images as the run did: its image processor beside the weights
    export = str(tmp_path / "out" / "model")
    assert vision.load_image_processor(export).to_dict() == vision.load_image_processor(
        str(tmp_path / "out" / "tiny_model_init")).to_dict()
    assert vision.is_vision_model(model_loading.load_model(export, {"dtype": "float32"}))


SHARDED_FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5"]
STREAMED = "qwen3_5"  # run with --max_staleness=1: its image prompts stream through the places
WITH_WEIGHTS = ("qwen2_5_vl", "qwen3_vl")  # folders with safetensors weights: 2 processes read their own shards


def write_vl_folder(path, family, extra_tokens):
    """A tiny vision-language model's folder (config, tokenizer, image processor), with its weights for the
    families of WITH_WEIGHTS (a Qwen2.5-VL checkpoint names its parts as Qwen2.5-VL is published)."""
    from transformers import AutoModelForImageTextToText
    cfg, tok, processor = tiny_vl_parts(family, extra_tokens=extra_tokens)
    for part in (cfg, tok, processor):
        part.save_pretrained(path)
    if family in WITH_WEIGHTS:
        torch.manual_seed(0)
        AutoModelForImageTextToText.from_config(cfg).save_pretrained(path)


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """The shapes task on each family, with 1 process and with 2 (torchrun, FSDP2 over gloo): each world size one
    launch that runs the families one after another (tests/run_train.py --runs), the two launches side by side.
    Qwen2.5-VL and Qwen3-VL from folders with weights (2 processes read their own shards; 1 loads the model whole),
    Qwen3.5 from a folder without (both build the whole model). {(family, world size): (out_dir, its output)}."""
    import concurrent.futures
    from tasks import shapes
    from launches import launch_runs
    t = tmp_path_factory.mktemp("vl")
    # a reward that differs between completions from the first step (a random model rarely names a colour), so
    # that the gradients compared are not zero; it also reads the pictures it is given
    reward = t / "spread.py"
    reward.write_text("def spread(prompts, completions, images, **_):\n"
                      "    return [(ord(c[:1] or ' ') % 5) / 4 + float(im[0].mean()) / 1000 "
                      "for c, im in zip(completions, images)]\n")
    dirs, runs = {}, {1: [], 2: []}
    for family in SHARDED_FAMILIES:
        for nproc in (1, 2):
            out_dir = dirs[family, nproc] = str(t / f"{family}-{nproc}")
            path = os.path.join(out_dir, "tiny_model_init")  # where run_train.py reads it from
            write_vl_folder(path, family, list(shapes.COLOURS))
            model = [f"--reward_funcs={reward}:spread", f"--model={path}"]
            runs[nproc].append([f"--out_dir={out_dir}", "--task=shapes", "--max_steps=2", "--save_every=0",
                                "--log_every=1", "--print_completions_every=0", "--prompts_per_step=4", *model,
                                *(["--max_staleness=1"] if family == STREAMED else [])])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        said = {}
        for job in [pool.submit(launch_runs, runs[w], w, str(t), f"vl{w}") for w in (1, 2)]:
            said.update(job.result())
    return {key: (out_dir, said[out_dir]) for key, out_dir in dirs.items()}


@pytest.mark.parametrize("family", SHARDED_FAMILIES)
def test_one_and_two_processes_sample_and_train_image_prompts_alike(sharded_runs, family):
    """The shapes task under torchrun (FSDP2 over gloo) on tiny Qwen2.5-VL, Qwen3-VL and Qwen3.5 models written to
    folders: every step's sampled tokens, loss and gradient norm as with 1 process, the two processes reading
    their own shards of the language model and the vision tower where the folder holds weights (Qwen3.5 with the
    sampler a step ahead: below)."""
    from launches import metrics, tokens
    (one, said_one), (two, said_two) = sharded_runs[family, 1], sharded_runs[family, 2]
    assert "the whole model in each process" in said_one
    shards = "each process read its own shards"
    assert (shards in said_two) == (family in WITH_WEIGHTS), said_two[-2000:]
    assert tokens(one) == tokens(two) and len(tokens(one)) == 2
    for a, b in zip(metrics(one), metrics(two)):
        assert a["reward"] == b["reward"] and a["grad_norm"] > 0
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-8)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_image_prompts_in_a_stream_ahead_of_the_step_train_alike_on_one_and_two_processes(sharded_runs):
    """--max_staleness=1 (the Qwen3.5 runs): rows of the next step, their image prompts prefilled into the
    stream's places, decode while a step's last rows run on and carry over the optimizer step; 2 processes sample
    and train as 1 does."""
    from launches import metrics, tokens
    (one, _), (two, _) = sharded_runs[STREAMED, 1], sharded_runs[STREAMED, 2]
    assert tokens(one) == tokens(two) and len(tokens(one)) == 2
    for a, b in zip(metrics(one), metrics(two)):
        assert a["reward"] == b["reward"] and a["rows_carried"] == b["rows_carried"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-8)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert metrics(two)[-1]["rows_carried"] > 0 and metrics(two)[-1]["staleness_max"] == 1


QWEN_VL_TEMPLATE = (  # how the Qwen-VL chat templates render text and image parts (written out here, no download)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_conversational_prompts_with_image_parts_or_an_image_column():
    import tasks
    _, tok, encoder = tiny_vl("qwen2_5_vl")
    tok.chat_template = QWEN_VL_TEMPLATE
    to_row = tasks._prompt_column_row(tasks._chat_formatter(tok), messages=True)
    # an image column beside text messages: the images go first in the first user message (TRL's convention)
    column = to_row({"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what?"}],
                     "images": [picture(1), picture(2)]})
    assert column["prompt"].endswith(f"<|im_start|>user\n{PAD}{PAD}what?<|im_end|>\n<|im_start|>assistant\n")
    assert column["prompt_text"] == "what?"
    # image parts where the conversation puts them
    parts = to_row({"prompt": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"},
                                                            {"type": "text", "text": "b"}]}],
                    "image": picture(3)})
    assert f"a{PAD}b" in parts["prompt"] and parts["prompt_text"] == "ab"
    assert tasks._prompt_problem([{"role": "user", "content": [{"type": "video"}]}]) is not None
    texts, images = encoder([column, parts], [column["prompt"], parts["prompt"]])
    assert [g.shape[0] for g in images.grid] == [2, 1] and texts[0].count("<|image_pad|>") > 2


def test_image_prompts_on_a_model_without_a_vision_tower_stop_at_start(tmp_path, tiny_dir):
    import train
    with pytest.raises(SystemExit, match="its prompts hold images, and Qwen2ForCausalLM cannot see them: it has no "
                                         "vision tower"):
        train.main([f"--out_dir={tmp_path / 'out'}", "--task=shapes", f"--model={tiny_dir}", "--max_steps=1"])


def _picture_dataset(folder, n=4):
    """A .jsonl of the shapes task's rows in `folder` whose pictures are PNG files in imgs/ beside it, named by
    relative paths; (the file's path, the pictures)."""
    import json
    import random

    from PIL import Image

    from tasks import shapes
    rows = shapes.prompts(random.Random(0), n)
    (folder / "imgs").mkdir(parents=True)
    with open(folder / "own.jsonl", "w") as f:
        for i, row in enumerate(rows):
            Image.fromarray(row["images"][0]).save(folder / "imgs" / f"{i:03d}.png")
            f.write(json.dumps({"prompt": row["prompt"], "image": f"imgs/{i:03d}.png", "answer": row["answer"]}) + "\n")
    return str(folder / "own.jsonl"), [row["images"][0] for row in rows]


def test_relative_image_paths_are_read_from_the_dataset_files_folder(tmp_path, monkeypatch):
    """What the image processor makes of a dataset's rows (relative paths, run from another folder) equals what it
    makes of the pictures written."""
    import tasks
    path, pictures = _picture_dataset(tmp_path / "data")
    monkeypatch.chdir(tmp_path)  # not the dataset's folder: imgs/000.png is not found from here
    task = tasks.get_task("shapes", dataset=path)
    cfg, tok, processor = tiny_vl_parts("qwen2_5_vl")
    encoder = vision.ImageEncoder(processor, tok, cfg.image_token_id)
    prompts = [r["prompt"] for r in task.rows]  # the file's rows in its order (none held out)
    _, loaded = encoder(task.rows, prompts)
    _, written = encoder([{"images": [p]} for p in pictures], prompts)
    assert len(loaded.pixel_values) == len(pictures)
    for a, b in zip(loaded.pixel_values, written.pixel_values):
        assert torch.equal(a, b)


def test_an_image_that_does_not_open_stops_the_run_at_start_naming_the_row_and_the_path(tmp_path):
    import tasks
    import train
    path, _ = _picture_dataset(tmp_path)
    os.remove(tmp_path / "imgs" / "002.png")
    with pytest.raises(SystemExit) as e:
        train.main([f"--out_dir={tmp_path / 'out'}", "--task=shapes", f"--dataset={path}", "--max_steps=1"])
    assert e.value.code == (f"task shapes: dataset {path}, row 2: image 'imgs/002.png' does not open (no such file "
                            f"{tmp_path / 'imgs' / '002.png'})")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    (tmp_path / "imgs" / "002.png").write_text("not a picture")
    with pytest.raises(ValueError, match=r"^dataset .*own\.jsonl, row 2: image 'imgs/002\.png' does not open "
                                         r"\(cannot identify image file"):
        tasks.get_task("shapes", dataset=path)


def test_shared_prompts_on_a_vision_language_model_stops_in_one_line(tmp_path):
    """--shared_prompts would do nothing on a vision-language model (each row's prompt runs on its own forward):
    the run stops naming the setting and the model class, as other settings that carry no images do."""
    from config import Config
    from runs import setup
    from runs.cli import ConfigError
    from tasks import shapes
    import tasks
    path = str(tmp_path / "vl")
    write_vl_folder(path, "qwen2_5_vl", list(shapes.COLOURS))
    model = model_loading.load_model(path, {"dtype": "float32"}, "cpu", seed=0)
    tok = model_loading.load_tokenizer(path)
    cfg = Config(model=path, task="shapes", shared_prompts=True, out_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError) as e:
        setup.load_images(cfg, model, tok, tasks.get_task("shapes"))
    assert e.value.code == ("config error: --shared_prompts: has no effect on Qwen2_5_VLForConditionalGeneration: a "
                            "vision-language model samples and trains each row's prompt on its own forward; leave it "
                            "off")
