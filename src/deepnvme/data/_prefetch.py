"""The read-ahead loop behind :meth:`TokenDataset.batches`: plan, submit, wait, gather, in order.

Up to ``prefetch`` batches are in flight, each read into its own buffer from a
:class:`~deepnvme.memory.pinned.BufferPool` of ``prefetch`` page-locked buffers; the oldest is
gathered into a fresh ``[batch, seq_len + 1]`` tensor and its buffer goes back to the pool
before the next batch is submitted. Runs on the consumer's thread; the I/O runs on the handle's.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ..memory.pinned import BufferPool, new_cpu_locked_tensor
from ._plan import BatchPlan

if TYPE_CHECKING:
    from .dataset import TokenDataset

__all__ = ["iterate_batches"]

log = logging.getLogger(__name__)

_InFlight = tuple[BatchPlan, torch.Tensor, "Future[int]"]


def iterate_batches(ds: TokenDataset, order: Iterable[int], batch_size: int, *, prefetch: int,
                    pin_memory: bool, drop_last: bool) -> Iterator[torch.Tensor]:
    """Yield the batches of ``order``; see :meth:`TokenDataset.batches` for the contract.
    Leaving early (``close()``, an error) waits for the reads in flight and frees the buffers."""
    pool = BufferPool(ds.buffer_bytes(batch_size), prefetch)
    pending: collections.deque[_InFlight] = collections.deque()
    samples = iter(order)
    try:
        while True:
            chunk = list(itertools.islice(samples, batch_size))
            if not chunk or (drop_last and len(chunk) < batch_size):
                break
            plan = ds.plan(chunk)  # IndexError here, before anything of this batch is read
            if len(pending) == prefetch:
                yield _finish(ds, pending.popleft(), pool, pin_memory)
            buffer = pool.acquire()
            try:
                pending.append((plan, buffer, ds.submit_plan(plan, buffer)))
            except BaseException:
                pool.release(buffer)
                raise
        while pending:
            yield _finish(ds, pending.popleft(), pool, pin_memory)
    finally:
        _abandon(pending, pool)


def _finish(ds: TokenDataset, item: _InFlight, pool: BufferPool, pin_memory: bool) -> torch.Tensor:
    """Wait for one batch's reads and copy its samples out; the buffer returns to the pool."""
    plan, buffer, future = item
    try:
        ds.check_count(plan, future.result())
        rows, tokens = len(plan.sample_at), ds.geometry.tokens
        dtype = ds.dtype if ds.keep_dtype else torch.int64
        if pin_memory:
            out = new_cpu_locked_tensor(rows * tokens, dtype).view(rows, tokens)
        else:
            out = torch.empty((rows, tokens), dtype=dtype)
        ds.gather(plan, buffer, out)
    finally:
        pool.release(buffer)
    return out


def _abandon(pending: collections.deque[_InFlight], pool: BufferPool) -> None:
    """Wait for reads nobody will consume (their buffers must not be reused while in flight)."""
    while pending:
        _plan, buffer, future = pending.popleft()
        exc = future.exception()
        if exc is not None:
            log.debug("deepnvme: read of an abandoned batch failed: %s", exc)
        pool.release(buffer)
    pool.close()
