"""Handles on one kernel engine (io_uring or Linux AIO), for the fault and batch tests that run
once per kernel engine available here (the ``kernel`` fixture: conftest.py)."""

from __future__ import annotations

import deepnvme
from deepnvme.config import IOConfig

from ...conftest import AVAILABLE_ENGINES

KERNEL_ENGINES = [e for e in ("io_uring", "aio") if e in AVAILABLE_ENGINES]


def make(engine, **cfg):
    """A handle on ``engine``: 1 MiB blocks, depth 8, two workers, unless ``cfg`` says otherwise."""
    base = dict(block_size=1 << 20, queue_depth=8, intra_op_parallelism=2, engine=engine)
    base.update(cfg)
    return deepnvme.AioHandle(config=IOConfig(**base))
