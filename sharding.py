"""Distributed setup from torchrun's environment, with a one-process fallback."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def master(self):  # only this process prints, logs and exports
        return self.rank == 0


def setup(device=None):
    """Read RANK / LOCAL_RANK / WORLD_SIZE set by torchrun; without them, one process.

    NCCL on CUDA, gloo on CPU. `device` ("cpu", "cuda") overrides the choice.
    """
    use_cuda = torch.cuda.is_available() if device in (None, "", "auto") else str(device).startswith("cuda")
    if "RANK" not in os.environ:
        return Dist(0, 0, 1, torch.device("cuda" if use_cuda else "cpu"))
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    return Dist(rank, local_rank, world, dev)


def teardown():
    if dist.is_initialized():
        dist.destroy_process_group()
