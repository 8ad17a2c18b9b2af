"""``unit.common`` stand-in: ``DistributedTest`` runs each test once, in this process, as rank 0.

DeepSpeed's version forks ``world_size`` processes and initialises torch.distributed around each
test. The aio/gds tests only use the rank to name files, so one in-process run is the same
check; classes asking for ``world_size > 1`` still run once (rank 0), and the summary the
runner prints says so.
"""

from __future__ import annotations


class DistributedTest:
    """Base class of DeepSpeed's distributed tests; its class attributes are accepted and unused."""

    world_size: int | list[int] = 2
    reuse_dist_env = False
    requires_cuda_env = True
    init_distributed = True
    set_dist_env = True
    backend = "nccl"
