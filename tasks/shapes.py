"""The image task: a picture of three coloured shapes, "Which colour is the square?", four colours to choose from.

Generated in code, small enough for a tiny vision-language model to learn on a
CPU: a 24 x 24 picture whose 3 x 3 cells of 8 x 8 pixels hold a square, a disc
and a triangle, each a different colour of four. The tiny model's vision tower
cuts it into 4 x 4 patches and merges 2 x 2 of them into one embedding, so each
cell is one image token; the language model has to find the token with the
square and name its colour. Each colour is one token of the tiny tokenizer, so
an answer is one token; the reward counts the completion's mentions of the
square's colour (four of them, in the default four tokens, score 1). A random policy rarely writes a colour word at all; one that
names a colour at random is right a quarter of the time.

`write_tiny_model` writes the tiny Qwen2.5-VL the task runs on with --model=tiny (the default): a
config, a byte-level tokenizer with the vision tokens and the colours, and the
image processor's settings (no weights: train.py initialises them).
"""

import os

import numpy as np

from tasks import Task

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
SHAPES = ("square", "disc", "triangle")
CELL, GRID = 8, 3  # pixels per cell (one image token of the tiny model), cells per side
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # the Qwen-VL chat templates' image placeholder
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _shape_mask(shape):
    """(CELL, CELL) bool: the shape drawn in a cell."""
    y, x = np.mgrid[0:CELL, 0:CELL]
    c = (CELL - 1) / 2
    if shape == "square":  # the whole cell: the most colour of the three, which the tiny model can learn to find
        return np.ones((CELL, CELL), dtype=bool)
    if shape == "disc":
        return (y - c) ** 2 + (x - c) ** 2 <= 2.5 ** 2
    return (y >= 2) & (y < CELL - 1) & (np.abs(x - c) <= (y - 2) / 2 + 0.5)  # a triangle, apex at the top


def draw(rng):
    """(picture (24, 24, 3) uint8 on white, {shape: colour name})."""
    picture = np.full((CELL * GRID, CELL * GRID, 3), 255, dtype=np.uint8)
    cells = rng.sample(range(GRID * GRID), len(SHAPES))
    colours = rng.sample(list(COLOURS), len(SHAPES))
    for shape, cell, colour in zip(SHAPES, cells, colours):
        r, c = divmod(cell, GRID)
        block = picture[r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL]
        block[_shape_mask(shape)] = COLOURS[colour]
    return picture, dict(zip(SHAPES, colours))


QUESTION = "Which colour is the square?\n"  # the four colours are the choices


def prompts(rng, n):
    """`n` rows: the prompt (the image's placeholder, then the question), the picture, the answer."""
    rows = []
    for _ in range(n):
        picture, colours = draw(rng)
        rows.append({"prompt": IMAGE + QUESTION, "prompt_text": QUESTION, "images": [picture],
                     "answer": colours["square"]})
    return rows


def square_colour_reward(prompts, completions, answer, **_):
    """How many times the completion names the square's colour, over 4 (at most 1): 1 for a completion of the
    colour alone when completions are the default 4 tokens. Partial credit, as in next_letter: a random policy
    names it now and then, which gives the first steps something to learn from. (The images are among the
    keywords a reward function gets, as `images`.)"""
    return [min(1.0, c.count(a) / 4) for c, a in zip(completions, answer)]


def write_tiny_model(path):
    """Write the tiny vision-language model's config, tokenizer and image processor (no weights) to `path`."""
    from transformers import Qwen2_5_VLConfig

    import model_loading

    os.makedirs(path, exist_ok=True)
    tok = model_loading.build_byte_tokenizer(extra_tokens=list(COLOURS))
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    # patches of 4 x 4 pixels (x 2 frames, a still image repeated), 2 x 2 of them merged: one token per cell
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=CELL * GRID, fullatt_block_indexes=[0])
    Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                     video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                     vision_end_token_id=ids["<|vision_end|>"], eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=True).save_pretrained(path)
    _image_processor().save_pretrained(path)
    return path


def _image_processor():
    """The Qwen-VL image processor sized for the task's pictures: 24 x 24 pixels stay as they are."""
    try:
        from transformers import Qwen2VLImageProcessorPil as Processor  # the Pillow backend, no torchvision
    except ImportError:  # pragma: no cover
        from transformers import Qwen2VLImageProcessor as Processor
    side = CELL * GRID
    return Processor(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=side * side,
                     max_pixels=side * side)


def make(ctx):
    return Task(prompts, [square_colour_reward], accuracy_reward="square_colour_reward")
