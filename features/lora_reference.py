"""LoRA's reference: the policy with its adapters off, with no second copy of the weights.

Applied by features/apply.py when LoRA trains adapters and beta > 0 (runs/setup.py then builds no reference
model): `run.reference`, which the core's train.reference_logprobs calls as it would call the reference model,
runs the policy's forward with every adapter disabled (layers/lora.py's `adapters_disabled`).
"""

from layers import lora


class AdaptersOff:
    """Called as a sharded model is (`model(fn, *args, **kwargs)`): the policy's forward, its adapters off."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, fn, *args, **kwargs):
        with lora.adapters_disabled(self.policy):
            return self.policy(fn, *args, **kwargs)


def apply(run):
    run.reference = AdaptersOff(run.policy)
