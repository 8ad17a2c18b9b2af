"""``deepspeed.comm`` stand-in: one process, rank 0, unless torch.distributed is initialised."""

from __future__ import annotations

import torch.distributed as torch_dist


def is_initialized() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def get_rank() -> int:
    return torch_dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return torch_dist.get_world_size() if is_initialized() else 1


def barrier() -> None:
    if is_initialized():
        torch_dist.barrier()
