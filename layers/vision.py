"""Images in prompts: the processor's pixel values, the image tokens' embeddings and the rotary positions.

A vision-language model (Qwen2.5-VL, Qwen3-VL, Qwen3.5) reads a prompt in
which each image stands as a run of placeholder tokens (the processor's
`image_token`, as many as the vision tower makes embeddings of that image).
Its forward then swaps those tokens' embeddings for the vision tower's and
gives every token three rotary positions (time, height, width: "mrope"): an
image's tokens lie on a grid, the text after it continues from the largest
position the image used, so a row's text positions run `delta` ahead of its
token count.

Here those pieces are computed once and given to the model's own language
model, in the sampler's prefill and in the training and reference forwards,
instead of letting the model's forward find them:
- the image tokens are the prompt's alone (a completion that samples the
  placeholder token is text there: it has no image behind it);
- each prompt's images are processed once (`ImageEncoder`), and the vision
  tower runs once per distinct prompt in a forward (`features`), not once per
  completion of its group;
- decode steps continue the text positions as `position + delta` on all three
  axes, which is what the model's own generation does.
Of the project it imports nothing.
"""

from dataclasses import dataclass

import torch

IMAGE_COLUMNS = ("image", "images")


def is_vision_model(model):
    """True for a model with a vision tower whose language model this file drives: the Qwen-VL family's layout
    (a language model, the vision tower's features, multi-axis rotary positions). Others with a vision tower
    (Gemma 3, ...) run text prompts as any model does; prompts with images stop the run at start."""
    inner = getattr(model, "base_model", None)
    return (getattr(model.config, "vision_config", None) is not None and hasattr(inner, "language_model")
            and hasattr(inner, "get_image_features") and hasattr(inner, "get_rope_index"))


def row_images(row):
    """A data row's images, a list (the `images` column, or the `image` column as one), [] when it has none."""
    if row.get("images") is not None:
        images = row["images"]
        return list(images) if isinstance(images, (list, tuple)) else [images]
    if row.get("image") is not None:
        return [row["image"]]
    return []


@dataclass
class PromptImages:
    """Each row's processed images: its pixel values (patches, D) and grid (images, 3) (time, height, width in
    patches). The rows of one prompt (a group) hold the same tensor objects: encoded once, and `features` runs the
    vision tower once for all of them."""
    pixel_values: list
    grid: list

    def rows(self, index):
        index = index.tolist() if torch.is_tensor(index) else range(len(self.grid))[index] \
            if isinstance(index, slice) else list(index)
        return PromptImages([self.pixel_values[i] for i in index], [self.grid[i] for i in index])

    def to(self, device):
        moved = {}  # keep shared tensors shared
        for t in self.pixel_values + self.grid:
            if id(t) not in moved:
                moved[id(t)] = t.to(device)
        return PromptImages([moved[id(t)] for t in self.pixel_values], [moved[id(t)] for t in self.grid])


def load_image_processor(name_or_path):
    """The model's image processor (AutoImageProcessor), or None when the folder or hub id has none."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(name_or_path)
    except (OSError, ValueError):
        return None


class ImageEncoder:
    """Prompt text with one placeholder token per image -> the text with each placeholder repeated as many times
    as the image has embeddings, and the rows' PromptImages.

    The placeholder is the model's image token (config.image_token_id) as the tokenizer spells it; the count per
    image is its grid's patches over merge_size^2 (the vision tower merges merge_size x merge_size patches into
    one embedding), the rule of the Qwen-VL processors.
    """

    def __init__(self, image_processor, tokenizer, image_token_id):
        self.image_processor = image_processor
        self.token = tokenizer.convert_ids_to_tokens(int(image_token_id))
        self.merge = int(getattr(image_processor, "merge_size", 1) or 1)

    @classmethod
    def for_model(cls, model, tokenizer, image_processor):
        """The encoder of a vision-language model, or None for any other model."""
        if not is_vision_model(model):
            return None
        if image_processor is None:
            raise ValueError(f"{type(model).__name__} sees images, but its folder has no image processor "
                             f"(preprocessor_config.json)")
        return cls(image_processor, tokenizer, model.config.image_token_id)

    def __call__(self, rows, prompts):
        """(prompts with their placeholders expanded, PromptImages); rows that are one object share their images."""
        done = {}
        texts, pixels, grids = [], [], []
        for row, prompt in zip(rows, prompts):
            key = id(row)
            if key not in done:
                done[key] = self._one(row_images(row), prompt)
            text, pv, grid = done[key]
            texts.append(text)
            pixels.append(pv)
            grids.append(grid)
        return texts, PromptImages(pixels, grids)

    def _one(self, images, prompt):
        count = prompt.count(self.token)
        if count != len(images):
            raise ValueError(f"a prompt holds {count} image placeholder(s) {self.token!r} for {len(images)} "
                             f"image(s): {prompt[:80]!r}")
        if not images:
            return prompt, torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)
        out = self.image_processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"].long()
        pieces = prompt.split(self.token)
        text = pieces[0] + "".join(self.token * int(g.prod() // self.merge ** 2) + rest
                                   for g, rest in zip(grid, pieces[1:]))
        return text, out["pixel_values"], grid


# ----------------------------------------------------------------------------- the forward's pieces


def image_mask(model, input_ids, prompt_columns, real):
    """(N, S) True at the prompt's image tokens: the first `prompt_columns` columns' real tokens that are the image
    token; a completion's are text."""
    mask = (input_ids == model.config.image_token_id) & real.bool()
    mask[:, prompt_columns:] = False
    return mask


def features(model, images):
    """The vision tower's embeddings of the rows' images: (image tokens of all rows in order, D), and for models
    that add them in early layers (Qwen3-VL's deepstack) a list per layer of the same shape, else None.
    Each distinct image tensor goes through the tower once."""
    unique, slot = {}, []
    for pv, grid in zip(images.pixel_values, images.grid):
        if grid.shape[0] == 0:
            slot.append(None)
            continue
        slot.append(unique.setdefault(id(pv), (len(unique), pv, grid))[0])
    if not unique:
        return None, None
    parts = list(unique.values())
    inner = model.base_model
    out = inner.get_image_features(torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]),
                                   return_dict=True)
    # split per image by the model; regrouped per prompt (a prompt may hold several images)
    sizes = [int(p[2].shape[0]) for p in parts]

    def per_prompt(split):
        it, out_ = iter(split), []
        for n in sizes:
            out_.append(torch.cat([next(it) for _ in range(n)]))
        return out_
    embeds = per_prompt(out.pooler_output)
    rows = lambda per: torch.cat([per[s] for s in slot if s is not None])  # noqa: E731
    deep = getattr(out, "deepstack_features", None)
    deep = [rows(per_prompt(layer)) for layer in deep] if deep else None
    return rows(embeds), deep


def rope_positions(model, input_ids, mask, images, real):
    """The rotary positions (3, N, S) of rows whose image tokens `mask` marks and real tokens `real`; padding 0.
    And each row's delta (N,): its text position past the prompt minus its token position."""
    grids = [g for g in images.grid if g.shape[0]]
    grid = torch.cat(grids).to(input_ids.device) if grids else None
    pos, _ = model.base_model.get_rope_index(input_ids, mm_token_type_ids=mask.int(), image_grid_thw=grid,
                                             attention_mask=real.long())
    real = real.bool()
    top = pos.amax(0).masked_fill(~real, -1).amax(1)  # (N,) the largest position of a real token
    return pos, top + 1 - real.long().sum(1)


def hidden_states(model, input_ids, mask, images, *, feats=None, **kwargs):
    """The language model's last hidden states (N, S, H) over the rows with their images' embeddings in place of
    the image tokens. kwargs: the language model's (position_ids, attention_mask, cache, use_cache)."""
    embeds = model.get_input_embeddings()(input_ids)
    if feats is None:
        feats = features(model, images)
    image, deep = feats
    extra = {}
    if image is not None:
        if int(mask.sum()) != image.shape[0]:
            raise ValueError(f"the prompts hold {int(mask.sum())} image tokens for {image.shape[0]} image embeddings "
                             f"(a prompt cut by max_prompt_length loses its first tokens: raise it)")
        embeds = embeds.masked_scatter(mask[..., None].expand_as(embeds), image.to(embeds.dtype))
        if deep is not None:
            extra = dict(visual_pos_masks=mask, deepstack_visual_embeds=[d.to(embeds.dtype) for d in deep])
    return model.base_model.language_model(input_ids=None, inputs_embeds=embeds, **extra, **kwargs)


def plain_inputs(model, input_ids, images):
    """What the model's own forward takes for rows (no padding) with their images: pixel values, grids and
    token types, for comparing with it (the model then finds the image tokens and positions itself)."""
    kinds = (input_ids == model.config.image_token_id).int()
    grids = [g for g in images.grid if g.shape[0]]
    if not grids:
        return {}
    return dict(pixel_values=torch.cat([p for p, g in zip(images.pixel_values, images.grid) if g.shape[0]]),
                image_grid_thw=torch.cat(grids), mm_token_type_ids=kinds)
