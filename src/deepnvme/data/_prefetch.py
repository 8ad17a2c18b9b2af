"""The read-ahead loop behind :meth:`TokenDataset.batches`: plan, submit, wait, gather, in order.

Batches are read in groups of :func:`group_size` (one ``read_many`` call, one buffer each);
up to ``prefetch // group`` groups are in flight, in buffers from a
:class:`~deepnvme.memory.pinned.BufferPool` of as many page-locked buffers. The oldest group's
batches are gathered into fresh ``[batch, seq_len + 1]`` tensors one at a time as the consumer
asks, then its buffer goes back to the pool and the next group is submitted. Runs on the
consumer's thread; the I/O runs on the handle's.
"""

from __future__ import annotations

import collections
import collections.abc
import itertools
import logging
from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ..memory.pinned import BufferPool, new_cpu_locked_tensor
from ._plan import BatchPlan

if TYPE_CHECKING:
    from ._reader import SampleReader

__all__ = ["iterate_batches"]

log = logging.getLogger(__name__)

_InFlight = tuple[BatchPlan, torch.Tensor, "Future[int]"]


def iterate_batches(reader: SampleReader, order: Iterable[int] | torch.Tensor, batch_size: int, *, prefetch: int,
                    pin_memory: bool, drop_last: bool,
                    device: torch.device | None = None) -> Generator[torch.Tensor, None, None]:
    """Yield the batches of ``order``; see :meth:`TokenDataset.batches` for the contract.
    Leaving early (``close()``, an error) waits for the reads in flight and frees the buffers."""
    if device is not None and device.type != "cpu":
        yield from _to_device(iterate_batches(reader, order, batch_size, prefetch=prefetch, pin_memory=False,
                                              drop_last=drop_last), device, batch_size, reader)
        return
    group = group_size(prefetch)
    slots = prefetch // group
    pool = BufferPool(reader.buffer_bytes(batch_size * group), slots)
    pending: collections.deque[_InFlight] = collections.deque()
    try:
        for chunk in _groups(order, batch_size * group):
            if drop_last:
                chunk = chunk[:chunk.numel() - chunk.numel() % batch_size]
            if not chunk.numel():
                break
            plan = reader.plan(chunk)  # IndexError here, before anything of this group is read
            if len(pending) == slots:
                yield from _finish(reader, pending.popleft(), pool, batch_size, pin_memory)
            buffer = pool.acquire()
            try:
                pending.append((plan, buffer, reader.submit(plan, buffer)))
            except BaseException:
                pool.release(buffer)
                raise
        while pending:
            yield from _finish(reader, pending.popleft(), pool, batch_size, pin_memory)
    finally:
        _abandon(pending, pool)


def _to_device(batches: Generator[torch.Tensor, None, None], device: torch.device, batch_size: int,
               reader: SampleReader) -> Iterator[torch.Tensor]:
    """Each batch copied to ``device`` through one reused page-locked staging batch; the copy
    is complete when the batch is yielded (``Tensor.to`` from page-locked memory, blocking)."""
    staging: torch.Tensor | None = None
    try:
        for batch in batches:
            if staging is None:
                staging = new_cpu_locked_tensor(batch_size * reader.geometry.tokens, batch.dtype)
            stage = staging[:batch.numel()].view(batch.shape)
            stage.copy_(batch)
            yield stage.to(device)
    finally:
        batches.close()  # waits for its reads in flight


def _groups(order: Iterable[int] | torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """``order`` in 1-D int64 tensors of ``size`` indices (the last may be shorter): slices of
    one tensor for a tensor or a sequence, else read lazily from the iterator."""
    if isinstance(order, (torch.Tensor, collections.abc.Sequence)):
        whole = torch.as_tensor(order, dtype=torch.int64).reshape(-1)
        for first in range(0, whole.numel(), size):
            yield whole[first:first + size]
        return
    samples = iter(order)
    while chunk := list(itertools.islice(samples, size)):
        yield torch.tensor(chunk, dtype=torch.int64)


def group_size(prefetch: int) -> int:
    """Batches read with one ``read_many`` call: a quarter of ``prefetch`` (at least 1), so the
    cost of a call is shared by several batches while four calls stay in flight."""
    return max(1, prefetch // 4)


def _finish(reader: SampleReader, item: _InFlight, pool: BufferPool, batch_size: int,
            pin_memory: bool) -> Iterator[torch.Tensor]:
    """Wait for one group's reads and yield its batches; then its buffer returns to the pool."""
    plan, buffer, future = item
    try:
        reader.check(plan, future.result())
        tokens = reader.geometry.tokens
        dtype = reader.out_dtype
        for first in range(0, plan.sample_at.numel(), batch_size):
            rows = plan.sample_at[first:first + batch_size]
            if pin_memory:
                out = new_cpu_locked_tensor(rows.numel() * tokens, dtype).view(rows.numel(), tokens)
            else:
                out = torch.empty((rows.numel(), tokens), dtype=dtype)
            reader.gather(rows, buffer, out, step=plan.step)
            yield out
    finally:
        pool.release(buffer)


def _abandon(pending: collections.deque[_InFlight], pool: BufferPool) -> None:
    """Wait for reads nobody will consume (their buffers must not be reused while in flight)."""
    while pending:
        _plan, buffer, future = pending.popleft()
        exc = future.exception()
        if exc is not None:
            log.debug("deepnvme: read of an abandoned batch failed: %s", exc)
        pool.release(buffer)
    pool.close()
