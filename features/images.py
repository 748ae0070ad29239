"""A vision-language policy's prompt images in the training forward.

Applied by features/__init__.py for a policy that sees images (runs/setup.py's `load_images` made its encoder):
each micro-batch's forward gets its rows' images (vision.PromptImages of the batch) through `run.forward_extras`.
The sampler gets them with the rows (sampling.rows_of).
"""


def apply(run):
    run.forward_extras.append(extras)


def extras(run, batch):
    """The micro-batch's prompts' images as completion_logprobs takes them; none for a batch without images."""
    if batch.images is None:
        return lambda mb: {}
    return lambda mb: {"images": batch.images.rows(mb.rows)}
