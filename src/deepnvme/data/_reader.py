"""The sample reader: the reads behind :class:`~deepnvme.data.TokenDataset` and its prefetcher.

It owns this process's :class:`~deepnvme.AioHandle` and turns sample indices into planned reads
(:mod:`deepnvme.data._plan`), submits them, checks the byte count and copies samples out of a
read buffer. The dataset (single samples, documents) and the read-ahead loop
(:mod:`deepnvme.data._prefetch`) both use it; neither reaches into the other.

Processes: a handle is made on first use and again in a forked child (DataLoader workers),
whose copy of the parent's handle has no worker threads; pickling drops it. Thread-safe
(the handle is).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ..config import IOConfig
from ..errors import DeepNVMeIOError
from ..handles.aio import AioHandle
from ..io.plan import PAGE_SIZE
from ..io.volume import VolumePath
from ..memory.pinned import BufferPool
from ..memory.views import aligned_empty
from ._plan import BatchPlan, SampleGeometry, batch_buffer_bytes, plan_apart, plan_batch, plan_runs

__all__ = ["SampleReader"]

_SPARE = 2  # read buffers kept between calls of SampleReader.samples
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SampleReader:
    """Reads samples laid out as ``geometry`` from ``bin_path``, whose tokens are ``dtype``,
    handing them out as ``out_dtype``; ``config`` sets the I/O handle (None: the defaults and
    the environment)."""

    def __init__(self, bin_path: str | VolumePath, geometry: SampleGeometry, *, dtype: torch.dtype,
                 out_dtype: torch.dtype, config: IOConfig | None) -> None:
        self.bin_path = bin_path
        self.geometry = geometry
        self.dtype = dtype
        self.out_dtype = out_dtype
        self._config = config
        self._handle: AioHandle | None = None
        self._pid = -1
        # read buffers of :meth:`samples` kept for the next call (at most _SPARE; list.pop and
        # append are atomic, so concurrent calls each take their own)
        self._spare: list[torch.Tensor] = []
        # the read-ahead pool the last iterator gave back, with its process id (at most one)
        self._pools: list[tuple[int, BufferPool]] = []

    def _io(self) -> AioHandle:
        """This process's handle (see the module docstring)."""
        pid = os.getpid()
        if self._handle is None or self._pid != pid:
            self._handle = AioHandle(config=self._config)
            self._pid = pid
        return self._handle

    @property
    def alignment(self) -> int:
        """The O_DIRECT alignment reads are planned with (bytes)."""
        return max(self._io().config.alignment, PAGE_SIZE)

    # --- planning ----------------------------------------------------------------------------

    def plan(self, samples: Sequence[int] | torch.Tensor, *, gap: int | None = None) -> BatchPlan:
        """The reads that fetch ``samples`` (ints or an integer tensor); ``gap`` None: one
        alignment unit (a hole that small is cheaper to read than a second request). IndexError
        for an index out of range."""
        cfg = self._io().config
        align = max(cfg.alignment, PAGE_SIZE)
        return plan_batch(samples, self.geometry, alignment=align, max_read=cfg.block_size,
                          gap=align if gap is None else gap)

    def plan_rows(self, idx: torch.Tensor) -> list[BatchPlan | None]:
        """Plans of the rows of ``idx`` (a ``[rows, n]`` int64 tensor) made together, where every
        index is in range and a row is a run of consecutive samples (one read of its span:
        :func:`~deepnvme.data._plan.plan_runs`) or its samples lie apart
        (:func:`~deepnvme.data._plan.plan_apart`); None for a row to plan with :meth:`plan` (all
        of them when an index is out of range or negative: :meth:`plan` raises or maps it when
        its row is reached)."""
        align = self.alignment
        if not idx.numel() or align & (align - 1):
            return [None] * idx.shape[0]
        low, high = (int(v) for v in torch.aminmax(idx))
        if low < 0 or high >= self.geometry.count:
            return [None] * idx.shape[0]
        runs = plan_runs(idx, self.geometry, alignment=align, max_read=self._io().config.block_size)
        if all(plan is not None for plan in runs):
            return runs
        apart = plan_apart(idx, self.geometry, alignment=align, gap=align)
        return [run or other for run, other in zip(runs, apart)]

    def buffer_bytes(self, batch_size: int) -> int:
        """Bytes of the read buffer one batch of ``batch_size`` samples needs at most."""
        align = self.alignment
        return batch_buffer_bytes(batch_size, self.geometry, alignment=align, gap=align)

    # --- reading -----------------------------------------------------------------------------

    def submit(self, plan: BatchPlan, buffer: torch.Tensor) -> Future[int]:
        """Start ``plan``'s reads into ``buffer`` (uint8, at least ``plan.buffer_bytes``), all
        in one call, on the .bin kept open by this process's handle; a future of the byte count.
        ``buffer`` must stay alive until the future completes. A plan with known ``bounds`` is
        handed over without a second check of its ranges (every completion is still checked)."""
        if plan.bounds is not None and isinstance(self.bin_path, str):
            return self._io()._read_planned(self.bin_path, buffer, (plan.buffer_offsets, plan.file_offsets, plan.sizes),
                                            plan.bounds, plan.buffer_bytes, keep_open=True)
        future: Future[int] = self._io().read_many_into(
            self.bin_path, buffer, buffer_offsets=plan.buffer_offsets, file_offsets=plan.file_offsets,
            sizes=plan.sizes, keep_open=True)
        return future

    def check(self, plan: BatchPlan, got: int) -> None:
        """Raise :class:`~deepnvme.errors.DeepNVMeIOError` unless ``got`` is the bytes
        ``plan`` reads."""
        if got != plan.nbytes:
            first = int(plan.file_offsets[0]) if plan.file_offsets.numel() else 0
            raise DeepNVMeIOError(f"read {got} of the {plan.nbytes} bytes planned", path=str(self.bin_path),
                                  offset=first, size=plan.nbytes)

    def read(self, plan: BatchPlan, buffer: torch.Tensor) -> None:
        """Execute ``plan`` into ``buffer``; blocks."""
        self.check(plan, self.submit(plan, buffer).result())

    def samples(self, samples: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Samples ``samples`` as the rows of a fresh ``[len, tokens]`` tensor of ``out_dtype``:
        one plan, one read call and one gather for all of them; blocks. Keeps up to two read
        buffers (each ``buffer_bytes(len(samples))`` at most) for the next call until :meth:`close`."""
        idx = torch.as_tensor(samples, dtype=torch.int64).reshape(-1)
        plan = self.plan_rows(idx.view(1, -1))[0] or self.plan(idx)
        if not plan.nbytes:
            return torch.empty((plan.sample_at.numel(), self.geometry.tokens), dtype=self.out_dtype)
        try:
            buffer = self._spare.pop()
        except IndexError:
            buffer = None
        if buffer is None or buffer.numel() < plan.buffer_bytes:
            buffer = aligned_empty(plan.buffer_bytes, alignment=self.alignment, min_bytes=0)
        self.read(plan, buffer)
        out = self.pick(plan, buffer).to(self.out_dtype, copy=plan.step is not None)
        if len(self._spare) < _SPARE:
            self._spare.append(buffer)
        return out

    def sample(self, i: int) -> torch.Tensor:
        """Sample ``i``, 1-D, as ``out_dtype`` (a fresh tensor); blocks."""
        self.geometry.byte_range(i)  # IndexError for an index out of range, named as such
        return self.samples([i])[0]

    def span(self, start: int, nbytes: int) -> torch.Tensor:
        """The tokens of bytes ``[start, start + nbytes)`` of the file, 1-D, as ``out_dtype``
        (a fresh tensor), read with the range widened to the alignment; blocks."""
        align = self.alignment
        lo = start - start % align
        hi = min(-(-(start + nbytes) // align) * align, self.geometry.file_size)
        buffer = aligned_empty(hi - lo, alignment=align, min_bytes=0)
        if nbytes:
            self.read(BatchPlan.single(lo, hi - lo, start - lo), buffer)
        tokens = buffer[start - lo:start - lo + nbytes].view(self.dtype)
        return tokens.to(self.out_dtype, copy=True)

    def pick(self, plan: BatchPlan, buffer: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """Every sample of ``plan`` from its read ``buffer`` (whose length is a multiple of 8) as
        the rows of a ``[n, tokens]`` tensor of the file's dtype: a strided view of ``buffer`` when
        they lie ``plan.step`` bytes apart (sequential order), else one ``index_select`` of every
        row at once, into ``scratch`` (a 1-D tensor of at least ``n x tokens`` elements of the
        file's dtype, reused by the caller) where given, else into a fresh tensor."""
        tokens, itemsize = self.geometry.tokens, self.geometry.itemsize
        n = plan.sample_at.numel()
        elements = buffer.view(self.dtype)
        if plan.step is not None:
            return elements.as_strided((n, tokens), (plan.step // itemsize, 1),
                                       elements.storage_offset() + int(plan.sample_at[0]) // itemsize)
        # one index_select over a view of every window of `tokens` elements (faster than a copy
        # per row); as same-size integers, since not every dtype has the kernel (uint16)
        same = _SAME_SIZE_INT[itemsize]
        raw = elements.view(same)
        windows = raw.as_strided((raw.numel() - tokens + 1, tokens), (1, 1), raw.storage_offset())
        at = plan.sample_at.div(itemsize, rounding_mode="floor")
        if scratch is None:
            return torch.index_select(windows, 0, at).view(self.dtype)
        picked = scratch.view(same).narrow(0, 0, n * tokens).view(n, tokens)
        return torch.index_select(windows, 0, at, out=picked).view(self.dtype)

    def take_pool(self, buffer_bytes: int, count: int) -> BufferPool:
        """A pool of ``count`` page-locked read buffers of ``buffer_bytes`` for one iterator: the
        one the last iterator gave back where it has these sizes (locking memory anew costs
        milliseconds per call), else a new one."""
        pid = os.getpid()
        try:
            owner, pool = self._pools.pop()
        except IndexError:
            return BufferPool(buffer_bytes, count)
        if owner == pid and pool.buffer_bytes == buffer_bytes and pool.count == count:
            return pool
        if owner == pid:  # another process's pool (a forked worker's copy) is left alone
            pool.close()
        return BufferPool(buffer_bytes, count)

    def give_pool(self, pool: BufferPool) -> None:
        """Keep ``pool`` (every buffer back in it) for the next iterator; one pool is kept, until
        :meth:`close`."""
        self._pools.append((os.getpid(), pool))
        while len(self._pools) > 1:
            try:
                owner, extra = self._pools.pop(0)
            except IndexError:
                break
            if owner == os.getpid():
                extra.close()

    # --- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop this process's I/O threads (a later read starts new ones). Idempotent."""
        if self._handle is not None and self._pid == os.getpid():
            self._handle.close()
        self._handle = None
        self._spare.clear()
        while self._pools:
            try:
                owner, pool = self._pools.pop()
            except IndexError:
                break
            if owner == os.getpid():
                pool.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handle"], state["_pid"], state["_spare"], state["_pools"] = None, -1, [], []
        return state
