"""Bad inputs fail with one line naming the path, row or entry: missing or damaged models, malformed
dataset prompts, LoRA targets that match nothing, exports that would hold NaN or be left half-written."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import model_loading  # noqa: E402
from runs import export as run_export  # noqa: E402

from layers import lora  # noqa: E402
import rewards  # noqa: E402
import tasks  # noqa: E402

LOADERS = [model_loading.load_tokenizer, model_loading.load_model, model_loading.load_reward_model]


def _one_line(e):
    text = str(e.value)
    assert "\n" not in text, text
    return text


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    """A tiny model folder with real weights (model.safetensors), as a download would leave it."""
    path = model_loading.write_tiny_model(str(tmp_path_factory.mktemp("weights")))
    model_loading.load_model(path, {"dtype": "float32"}, "cpu", seed=0).save_pretrained(path)
    return path


@pytest.fixture
def offline(monkeypatch):
    # no retries against an unreachable hub: fails at once, as on a machine without network
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


# ----------------------------------------------------------------------------- model paths

@pytest.mark.parametrize("load", LOADERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("path", ["/data/typo/qwen", "./mdoel", "../mdoel", "~/no/such/model", "a/b/c"])
def test_missing_local_model_folder_is_named(load, path):
    with pytest.raises(FileNotFoundError) as e:
        load(path)
    assert f"no such folder '{path}'" in _one_line(e)


def test_a_file_or_a_folder_without_config_is_not_a_model(tmp_path, weights_dir):
    file = os.path.join(weights_dir, "config.json")
    with pytest.raises(ValueError) as e:
        model_loading.load_model(file)
    assert file in _one_line(e) and "is a file" in str(e.value)
    with pytest.raises(FileNotFoundError) as e:
        model_loading.load_model(str(tmp_path))
    assert str(tmp_path) in _one_line(e) and "config.json" in str(e.value)
    with pytest.raises(ValueError) as e:
        model_loading.load_tokenizer(str(tmp_path))
    assert str(tmp_path) in _one_line(e) and "tokenizer" in str(e.value)


def test_folder_without_tokenizer_files_is_refused(tmp_path, weights_dir):
    # transformers builds an empty tokenizer from a bare config; training on empty prompts must not start
    (tmp_path / "config.json").write_text(open(os.path.join(weights_dir, "config.json")).read())
    with pytest.raises(ValueError) as e:
        model_loading.load_tokenizer(str(tmp_path))
    assert str(tmp_path) in _one_line(e)


@pytest.mark.parametrize("load", LOADERS, ids=lambda f: f.__name__)
def test_unreachable_hub_id_is_one_line(load, offline):
    with pytest.raises(OSError) as e:
        load("Qwen/Qwen2.5-0.5B-Instruct")
    assert "'Qwen/Qwen2.5-0.5B-Instruct' is neither a local folder nor loadable from the hub" in _one_line(e)


@pytest.mark.parametrize("keep", [4, 100, 0.5])
def test_truncated_safetensors_names_the_file(tmp_path, weights_dir, keep):
    import shutil
    path = str(tmp_path / "m")
    shutil.copytree(weights_dir, path)
    weights = os.path.join(path, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(int(size * keep) if isinstance(keep, float) else keep)
    for load in (model_loading.load_model, model_loading.load_reward_model):
        with pytest.raises(model_loading.DamagedWeightsError) as e:
            load(path)
        assert f"{weights} cannot be read (truncated or damaged" in _one_line(e)
    assert isinstance(e.value, ValueError)  # what train.py turns into a one-line exit
    model_loading.load_tokenizer(path)  # the tokenizer files are intact


def test_intact_weights_still_load(weights_dir):
    a = model_loading.load_model(weights_dir, {"dtype": "float32"}, seed=1)
    b = model_loading.load_model(weights_dir, {"dtype": "float32"}, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# ----------------------------------------------------------------------------- dataset prompts

def _write(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("bad, words", [
    (["a>", "b>"], "a list of 2 strings"),
    ([{"role": "user"}], "message 0 has no 'content'"),
    ([{"content": "a>"}], "message 0 has no 'role'"),
    ([{"role": "user", "content": "a>"}, 3], "item 1 is int"),
    ([{"role": "user", "content": ["a>"]}], "must be text"),
    ([], "empty list"),
    (7, "got int 7"),
    (None, "got NoneType"),
])
def test_malformed_prompt_names_file_and_row(tmp_path, bad, words):
    rows = [{"prompt": "a>", "answer": "b"}, {"prompt": "b>", "answer": "c"}, {"prompt": bad, "answer": "d"}]
    path = _write(tmp_path, rows)
    with pytest.raises(ValueError) as e:
        tasks.get_task("next_letter", dataset=path)
    text = _one_line(e)
    assert f"dataset {path}, row 2: 'prompt' must be text or a list of" in text and words in text, text


def test_row_numbers_are_the_files_also_with_held_out_rows(tmp_path):
    rows = [{"prompt": f"{a}>", "answer": "x"} for a in "abcdefg"] + [{"prompt": ["h>"], "answer": "x"}]
    with pytest.raises(ValueError, match=r"row 7: 'prompt'"):
        tasks.get_task("next_letter", dataset=_write(tmp_path, rows), eval_prompts=3)


def test_column_of_the_wrong_type_is_named(tmp_path):
    path = _write(tmp_path, [{"nums": [1, 2], "target": 3}, {"nums": 12, "target": 3}])
    with pytest.raises(ValueError) as e:
        tasks.get_task("countdown", dataset=path)
    assert f"dataset {path}, row 1: cannot be read" in _one_line(e)


@pytest.mark.parametrize("row, hint", [
    ({"question": "a>", "answer": "b"}, "the 'question' column looks like it: rename it to 'prompt', or use "
                                        "--task=gsm8k"),
    ({"messages": [{"role": "user", "content": "a>"}], "answer": "b"}, "the 'messages' column looks like it: "
                                                                        "rename it to 'prompt'"),
    ({"problem": "a>", "answer": "b"}, "the 'problem' column looks like it: rename it to 'prompt'"),
    ({"answer": "b"}, ""),
])
def test_missing_prompt_column_is_named_with_the_columns(tmp_path, row, hint):
    path = _write(tmp_path, [row, row])
    with pytest.raises(ValueError) as e:
        tasks.get_task("next_letter", dataset=path)
    text = _one_line(e)
    assert text.startswith(f"dataset {path}, row 0: missing column 'prompt' (columns: {sorted(row)})"), text
    assert hint in text and "must be text" not in text


def test_missing_question_column_of_gsm8k_points_at_a_likely_column(tmp_path):
    path = _write(tmp_path, [{"problem": "What is 1 + 1?", "answer": "#### 2"}])
    with pytest.raises(ValueError) as e:
        tasks.get_task("gsm8k", dataset=path)
    assert _one_line(e) == (f"dataset {path}, row 0: missing column 'question' (columns: ['answer', 'problem']); "
                            f"the 'problem' column looks like it: rename it to 'question'")


def test_binary_dataset_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "a>", "answer": "b"}\n{"prompt": "b>", "answer": "c"}\n'
                     b"\x7fELF\x02\x01\x01\x00\xd0\xff\n")
    with pytest.raises(ValueError) as e:
        tasks.get_task("next_letter", dataset=str(path))
    assert f"{path}:3: not UTF-8 text (byte 0xd0 at column 9)" in _one_line(e)
    # a byte-order mark is not an error
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a>", "answer": "b"}\n' * 2)
    assert len(tasks.get_task("next_letter", dataset=str(path)).rows) == 2


# ----------------------------------------------------------------------------- raw prompts reach reward functions

def _keys_agree(rows):
    assert rows and all(set(r) == set(rows[0]) for r in rows), [sorted(r) for r in rows]


@pytest.mark.parametrize("name", ["next_letter", "countdown"])
def test_procedural_tasks_carry_the_raw_prompt(name):
    task = tasks.get_task(name, tokenizer=model_loading.build_byte_tokenizer(), eval_prompts=2)
    rows = task.prompts_for_step(0, 1, 4)
    _keys_agree(rows + task.eval_rows)
    for r in rows + task.eval_rows:
        assert isinstance(r["prompt_text"], str) and r["prompt_text"] and r["prompt_text"] in r["prompt"]


def test_message_prompts_keep_their_messages(tmp_path):
    tok = model_loading.load_tokenizer(model_loading.write_tiny_model(str(tmp_path / "m"),
                                                                      chat_template=model_loading.TINY_CHAT_TEMPLATE))
    system = {"role": "system", "content": "Answer with one letter."}
    rows = [{"prompt": [system, {"role": "user", "content": f"{a}>"}], "answer": b} for a, b in zip("abcde", "bcdef")]
    rows.append({"prompt": "f>", "answer": "g"})  # a text prompt among message lists
    task = tasks.get_task("next_letter", tokenizer=tok, dataset=_write(tmp_path, rows), eval_prompts=2)
    drawn = task.prompts_for_step(0, 1, 4) + task.eval_rows
    _keys_agree(drawn)
    for r in drawn:
        assert isinstance(r["prompt_messages"], list) and all(set(m) >= {"role", "content"} for m in r["prompt_messages"])
        assert r["prompt_messages"][-1] == {"role": "user", "content": r["prompt_text"]}
        assert r["prompt"].endswith(r["prompt_text"] + "<|im_end|>\n<|im_start|>assistant\n") or \
            r["prompt"] == r["prompt_text"] == "f>"
    # the per-step fields a reward function receives, built the way the trainer builds them
    fields = {k: [r[k] for r in drawn] for k in drawn[0] if k != "prompt"}
    scores = rewards.score_completions(task.reward_funcs, [1.0], [r["prompt"] for r in drawn],
                                       [r["answer"] * 4 for r in drawn], fields)[0]
    assert scores.tolist() == [1.0] * len(drawn)


def test_text_prompts_get_no_messages_field(tmp_path):
    path = _write(tmp_path, [{"prompt": f"{a}>", "answer": "x"} for a in "abc"])
    rows = tasks.get_task("next_letter", dataset=path).prompts_for_step(0, 1, 3)
    _keys_agree(rows)
    assert all(r["prompt_text"] == r["prompt"] and "prompt_messages" not in r for r in rows)


# ----------------------------------------------------------------------------- LoRA targets

@pytest.fixture
def tiny_model(weights_dir):
    return model_loading.load_model(weights_dir, {"dtype": "float32"}, "cpu", seed=0)


def test_each_lora_target_must_match(tiny_model):
    with pytest.raises(ValueError) as e:
        lora.add_lora(tiny_model, 4, 8, "q_proj,v_prj,down_proj")
    text = _one_line(e)
    assert "'v_prj' matches no linear layer" in text
    assert "(the model has: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj)" in text
    with pytest.raises(ValueError, match=r"'v_prj', 'mlp\.nope' match no linear layer"):
        lora.add_lora(tiny_model, 4, 8, ["q_proj", "v_prj", "mlp.nope"])
    with pytest.raises(ValueError, match="lora_target_modules: empty"):
        lora.add_lora(tiny_model, 4, 8, " , ")
    # a refused call leaves the model as it was: no adapters, nothing frozen
    assert not lora.lora_modules(tiny_model) and all(p.requires_grad for p in tiny_model.parameters())


def test_lora_targets_may_be_dotted_tails(tiny_model):
    replaced = lora.add_lora(tiny_model, 4, 8, "self_attn.q_proj,mlp.down_proj")
    assert sorted(replaced) == sorted(f"model.layers.{i}.{n}" for i in range(2)
                                      for n in ("self_attn.q_proj", "mlp.down_proj"))


# ----------------------------------------------------------------------------- export

def test_export_refuses_non_finite_weights(tmp_path, tiny_model, weights_dir):
    tok = model_loading.load_tokenizer(weights_dir)
    out = str(tmp_path / "model")
    run_export.export_model(tiny_model, tok, out)
    before = {f: os.path.getmtime(os.path.join(out, f)) for f in os.listdir(out)}
    sd = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    sd["model.layers.1.mlp.up_proj.weight"][0, :3] = float("nan")
    with pytest.raises(ValueError) as e:
        run_export.export_model(tiny_model, tok, out, state_dict=sd)
    assert "'model.layers.1.mlp.up_proj.weight' holds 3 NaN/inf values" in _one_line(e)
    with torch.no_grad():
        tiny_model.model.norm.weight[0] = float("inf")
    with pytest.raises(ValueError, match="'model.norm.weight' holds 1 NaN/inf"):
        run_export.export_model(tiny_model, tok, out)
    # the earlier export is untouched and nothing else was left beside it
    assert {f: os.path.getmtime(os.path.join(out, f)) for f in os.listdir(out)} == before
    assert os.listdir(tmp_path) == ["model"]


def test_export_replaces_the_old_folder_whole(tmp_path, tiny_model, weights_dir, monkeypatch):
    tok = model_loading.load_tokenizer(weights_dir)
    out = str(tmp_path / "model")
    run_export.export_model(tiny_model, tok, out)
    (tmp_path / "model" / "stale.txt").write_text("from an older export")
    with torch.no_grad():
        tiny_model.model.norm.weight.fill_(2.0)
    run_export.export_model(tiny_model, tok, out)
    assert sorted(os.listdir(tmp_path)) == ["model"] and "stale.txt" not in os.listdir(out)
    loaded = model_loading.load_model(out, {"dtype": "float32"})
    assert torch.equal(loaded.model.norm.weight, torch.full_like(loaded.model.norm.weight, 2.0))

    # killed while writing: the complete export stays where it was, the partial one is cleared next time
    written = run_export._pwrite

    def dies(fd, tensor, pos):  # the first tensor written, then killed
        written(fd, tensor, pos)
        raise KeyboardInterrupt
    monkeypatch.setattr(run_export, "_pwrite", dies)
    with pytest.raises(KeyboardInterrupt):
        run_export.export_model(tiny_model, tok, out)
    assert sorted(os.listdir(tmp_path)) == ["model"]
    assert torch.equal(model_loading.load_model(out, {"dtype": "float32"}).model.norm.weight,
                       loaded.model.norm.weight)
