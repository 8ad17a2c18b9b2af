"""The read-ahead loop behind :meth:`TokenDataset.batches`: plan, submit, wait, pick, in order.

Batches are read in groups of :func:`group_size` (one ``read_many`` call, one buffer each);
up to ``prefetch // group`` groups are in flight, in buffers from a
:class:`~deepnvme.memory.pinned.BufferPool` of as many page-locked buffers. The groups of a
sequence or tensor order are planned a block at a time (:meth:`SampleReader.plan_rows`: a
fixed number of tensor calls for up to :data:`_BLOCK` samples). The oldest group's samples are
picked out of its buffer at once into one reused scratch tensor (``batch x group x (seq_len +
1)`` tokens of the file's dtype), and each batch is converted from it into a fresh ``[batch,
seq_len + 1]`` tensor as the consumer asks; then the buffer goes back to the pool and the next
group is submitted. The pool outlives the iterator, kept by the reader for the next one
(:meth:`SampleReader.take_pool`). Runs on the consumer's thread; the I/O runs on the handle's.
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
_BLOCK = 4096  # samples of a sequence or tensor order planned together (rows of whole groups)


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
    pool = reader.take_pool(reader.buffer_bytes(batch_size * group), slots)
    scratch = torch.empty(batch_size * group * reader.geometry.tokens, dtype=reader.dtype)
    pending: collections.deque[_InFlight] = collections.deque()
    try:
        # IndexError from the plans comes when its group's turn comes, before it is read
        for plan in _planned(reader, order, batch_size * group, batch_size, drop_last):
            if len(pending) == slots:
                yield from _finish(reader, pending.popleft(), pool, batch_size, pin_memory, scratch)
            buffer = pool.acquire()
            try:
                pending.append((plan, buffer, reader.submit(plan, buffer)))
            except BaseException:
                pool.release(buffer)
                raise
        while pending:
            yield from _finish(reader, pending.popleft(), pool, batch_size, pin_memory, scratch)
    finally:
        _abandon(pending, pool)
        reader.give_pool(pool)  # for the next iterator (SampleReader.close frees it)


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


def _planned(reader: SampleReader, order: Iterable[int] | torch.Tensor, size: int, batch_size: int,
             drop_last: bool) -> Iterator[BatchPlan]:
    """The plans of the groups of ``size`` samples of ``order`` (the last one cut to whole
    batches with ``drop_last``), those of a block planned together where they can be
    (:meth:`SampleReader.plan_rows`); a group that cannot is planned alone when its turn comes."""
    for block in _blocks(order, size):
        n = block.shape[1]
        if drop_last and n < size:
            block = block.narrow(1, 0, n - n % batch_size)
            if not block.numel():
                return
        for r, plan in enumerate(reader.plan_rows(block)):
            yield plan if plan is not None else reader.plan(block[r])


def _blocks(order: Iterable[int] | torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """``order`` as ``[groups, size]`` int64 tensors of whole groups, up to :data:`_BLOCK`
    samples each, and a last ``[1, k]`` one of the rest: slices of one tensor for a tensor or a
    sequence, else read lazily from the iterator a group at a time."""
    if isinstance(order, (torch.Tensor, collections.abc.Sequence)):
        whole = torch.as_tensor(order, dtype=torch.int64).reshape(-1)
        full = whole.numel() - whole.numel() % size
        step = max(1, _BLOCK // size) * size
        for first in range(0, full, step):
            yield whole[first:min(first + step, full)].reshape(-1, size)
        if full < whole.numel():
            yield whole[full:].reshape(1, -1)
        return
    samples = iter(order)
    while chunk := list(itertools.islice(samples, size)):
        yield torch.tensor(chunk, dtype=torch.int64).reshape(1, -1)


def group_size(prefetch: int) -> int:
    """Batches read with one ``read_many`` call: half of ``prefetch`` (at least 1), so the cost
    of a call (its hand-offs between threads, each a sleep and a wake-up) is shared by as many
    batches as can be while two calls stay in flight: one read while the other is consumed."""
    return max(1, prefetch // 2)


def _finish(reader: SampleReader, item: _InFlight, pool: BufferPool, batch_size: int, pin_memory: bool,
            scratch: torch.Tensor) -> Iterator[torch.Tensor]:
    """Wait for one group's reads and yield its batches, each converted from one pick of the
    whole group (:meth:`SampleReader.pick`, into ``scratch``); then its buffer returns to the pool."""
    plan, buffer, future = item
    try:
        reader.check(plan, future.result())
        picked = reader.pick(plan, buffer, scratch)
        n, dtype = picked.shape[0], reader.out_dtype
        for first in range(0, n, batch_size):
            rows = picked.narrow(0, first, min(batch_size, n - first))
            if pin_memory:
                out = new_cpu_locked_tensor(rows.numel(), dtype).view(rows.shape)
                yield out.copy_(rows)
            else:
                yield rows.to(dtype, copy=True)
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
