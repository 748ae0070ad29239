"""What a model does to its logits after the vocabulary projection: the one home of the final-logit transform.

The sampler's written-out decoder (layers/engine.py) applies it to the logits it samples from, and the
training head (logprobs.py, chunk by chunk with its own backward) to the logits it takes log-probs of: both take it
from `transformer.head_of`, which reads a model's settings into a Head, so the two cannot disagree. Imports torch
alone.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Head:
    """logits * scale, then, with a softcap c, c * tanh(logits / c) (Gemma 2/3/4's `final_logit_softcapping`,
    Cohere's `logit_scale`, Granite's and MiniCPM's `logits_scaling`). The sampler reads the model's own logits,
    so the training head must apply the same, or the two disagree silently."""
    scale: float = 1.0
    softcap: float = 0.0

    def apply(self, z):
        """z: raw logits (a fresh tensor, changed in place), in the dtype the transform runs in: the model's own
        in the sampler (the model computes it there), float32 in the training head."""
        if self.scale != 1.0:
            z.mul_(self.scale)
        if self.softcap:
            z = z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z

    def derivative(self, raw):
        """d apply(raw) / d raw, elementwise."""
        if not self.softcap:
            return self.scale
        return (1 - (raw * (self.scale / self.softcap)).tanh().square()) * self.scale
