"""--shared_prompts in training: the rows of a group, which share their prompt, in one micro-batch, where the
forward runs the prompt once and each completion as a branch of a tree over it (logprobs.py's SharedPrompts).

Applied by features/apply.py: it replaces `run.micro_batches` (train.micro_batches: rows of similar length
together). The sampler's side (each prompt prefilled once) is StaticDecoder's share (sampling.py).
"""

import logprobs


def apply(run):
    run.micro_batches = micro_batches
    run.forward = logprobs.TreeForward(run.forward)


def micro_batches(run, batch, rows, mask, loss_mask, T):
    """train.micro_batches with the rows' prompts given: each group's rows together, as a tree."""
    cfg = run.cfg
    return [logprobs.MicroBatch(rows[mb.rows], mb.cols, mb.t, mb.width)
            for mb in logprobs.shared_micro_batches(mask[rows], loss_mask[rows], T, cfg.micro_batch_size,
                                                    cfg.micro_batch_tokens, prompt_ids=batch.prompt_ids[rows])]
