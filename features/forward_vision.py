"""Prompts with images in the training forward (a vision-language model, layers/vision.py).

The rows' extra `images`, their vision.PromptImages: the language model runs with their embeddings in place of the
prompts' image tokens and their rotary positions, as in the sampler's prefill. The image tokens are laid out with
their rows (`rows.move`, logprobs.Layout).
"""

from layers import vision


class Forward:
    """The training forward around `inner` (logprobs.Forward or a variant of it), through the vision model where
    the rows' prompts hold images (`extras["images"]`)."""

    def __init__(self, inner):
        self.inner = inner

    def layout(self, model, input_ids, attention_mask, t, width, extras):
        return self.inner.layout(model, input_ids, attention_mask, t, width, extras)

    def written_out(self, model):
        return self.inner.written_out(model)

    def hidden(self, model, rows, extras):
        images = (extras or {}).get("images")
        if images is None or not any(g.shape[0] for g in images.grid):
            return self.inner.hidden(model, rows, extras)
        s = rows.input_ids.shape[1]
        pictures = rows.move(vision.image_mask(model, rows.input_ids, s - rows.t, rows.attention_mask.bool()))
        rope, _ = vision.rope_positions(model, rows.ids, pictures, images, rows.real)
        return vision.hidden_states(model, rows.ids, pictures, images, attention_mask=rows.mask, position_ids=rope,
                                    use_cache=False).last_hidden_state
