"""A vision-language policy's prompt images in the training forward.

Applied by features/apply.py for a policy that sees images (runs/setup.py's `load_images` made its encoder):
each micro-batch's forward gets its rows' images (vision.PromptImages of the batch) through `run.forward_extras`.
The sampler gets them with the rows (sampling.rows_of).
"""

import logprobs
from layers import vision


def apply(run):
    run.forward = Forward(run.forward)
    run.forward_extras.append(extras)


def extras(run, batch):
    """The micro-batch's prompts' images as completion_logprobs takes them; none for a batch without images."""
    if batch.images is None:
        return lambda mb: {}
    return lambda mb: {"images": batch.images.rows(mb.rows)}


class Forward(logprobs.Around):
    """The training forward around `inner` (logprobs.Forward or a variant of it), through the vision model where
    the rows' prompts hold images (`extras["images"]`)."""

    def hidden(self, model, rows, extras):
        images = (extras or {}).get("images")
        if images is None or not any(g.shape[0] for g in images.grid):
            return self.inner.hidden(model, rows, extras)
        s = rows.input_ids.shape[1]
        pictures = rows.move(vision.image_mask(model, rows.input_ids, s - rows.t, rows.attention_mask.bool()))
        rope, _ = vision.rope_positions(model, rows.ids, pictures, images, rows.real)
        return vision.hidden_states(model, rows.ids, pictures, images, attention_mask=rows.mask, position_ids=rope,
                                    use_cache=False).last_hidden_state
