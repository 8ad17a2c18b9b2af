"""Running a function in several gloo processes on CPU, with a hard deadline for the whole job."""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., None], world: int, store: str, stacks: float,
           args: tuple[Any, ...]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    faulthandler.dump_traceback_later(stacks, exit=True)  # a hang shows where each rank waits
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # A rank that passed leaves without the interpreter's finalization: there gloo's C++ threads
    # can still hold work whose tensors need the GIL, and torch aborts the process ("terminate
    # called without an active exception", SIGABRT; twice in a 4 -> 2 rank restore after every
    # assertion had passed). The atexit handlers (deepnvme's engines close there) still run.
    faulthandler.cancel_dump_traceback_later()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., None], world: int, tmp: str, *args: Any, deadline: float = 60.0) -> None:
    """``fn(rank, world, *args)`` in ``world`` spawned processes of one gloo world; a failure in
    any of them (with its traceback) or the deadline passing fails the test, killing the rest."""
    store = os.path.join(tmp, f"store-{time.monotonic_ns()}")
    ctx = mp.start_processes(_entry, args=(fn, world, store, deadline - 5, args), nprocs=world, join=False,
                             start_method="spawn")
    end = time.monotonic() + deadline
    try:
        while not ctx.join(timeout=max(0.1, end - time.monotonic())):
            if time.monotonic() > end:
                pytest.fail(f"{fn.__name__} on {world} ranks did not finish within {deadline:g} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()
