"""Fenced saves across ranks: this rank's share of a step written from the live tensors.

``CheckpointManager(staging="fenced")`` over several ranks copies nothing at ``save()`` but
the small items: the writer thread hands DCP's writer the live tensors of this rank's share
(the local shards of DTensors, the replicated tensors the plan gives this rank). Each tensor
item is *waiting*, *in flight* (DCP resolved it and is serializing its bytes into the file's
write buffers) or *done* (DCP closed the item's stream: its bytes left the live tensor).
A step pre-hook on each optimizer in the state (:class:`ShareFences`) runs
:meth:`ShareFence.protect` before the optimizer changes anything: every item not done that
this optimizer changes, or that no fenced optimizer owns, is copied into the staging arena if
waiting (the writer then writes the copy), or waited for if in flight; then the step goes on.

Staging: the one reused arena of :class:`~deepnvme.checkpoint._fence.Staging` (at most the
large items of this rank's share, each rounded up to 4096 bytes, capped by
``FencedStager(staging_bytes=)``; 0: never copy, the step waits for the write). When the arena
cannot hold every waiting item, those the writer reaches last are copied and the step waits for
the others. Items under 256 KiB and plain data are copied when the share is staged: at
``save()``, or on the writer thread for a *held* save (:meth:`ShareFences.hold`: the hooked
steps first wait until it is staged). The requirement is the single-process fenced stager's:
between ``save()`` and that optimizer step nothing else changes a saved tensor in place. CPU
tensors only.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from ...io.plan import align_up
from ...memory.copy import ParallelCopy
from ...memory.views import cast_to_byte_tensor
from .._arena import ALIGN
from .._fence import Staging
from ._dcp_step import StagedPlanner

__all__ = ["SMALL", "ShareFence", "ShareFences"]

log = logging.getLogger(__name__)

SMALL = 256 << 10  # items smaller than this are copied at save()
WAITING, IN_FLIGHT, DONE = 0, 1, 2


@dataclass(eq=False)
class _Item:
    """One large tensor item of the share: the live tensor, who changes it, its state."""

    index: MetadataIndex
    live: torch.Tensor
    owner: int | None  # id() of the fenced optimizer that changes it (None: no such optimizer)
    copy: torch.Tensor | None = None  # its bytes at save() time, once a fence copied them
    state: int = WAITING


def _storages(optimizer: torch.optim.Optimizer) -> list[int]:
    """The storages (``_cdata``) ``optimizer.step()`` changes: parameters and state tensors;
    a DTensor's local shard stands for it."""
    found: list[torch.Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
    found += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    out = []
    for t in found:
        local = t.to_local() if hasattr(t, "to_local") else t
        out.append(local.untyped_storage()._cdata)
    return out


def _slot(region: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor shaped as ``like`` over the arena bytes ``region``, whose storage is
    exactly ``region`` (so DCP's writer writes it as it is, without cloning it)."""
    flat = torch.frombuffer(region.numpy(), dtype=like.dtype, count=like.numel())
    return flat.view(like.shape)


class ShareFence:
    """The tensor items of one fenced save of this rank's share and their state (see the
    module); the small items and plain data staged at ``save()``. Thread-safe: the writer
    thread resolves items and hears them written, the training thread protects."""

    def __init__(self, staged: dict[MetadataIndex, torch.Tensor | io.BytesIO], items: list[_Item],
                 staging: Staging) -> None:
        self.staged = staged
        self.items = {it.index: it for it in items}
        self.order = items  # the writer's order
        self.copied_bytes = 0
        self._staging = staging
        self._cond = threading.Condition()
        self._used = 0  # arena bytes taken by copies
        self._ended = False

    # ---- writer side ----------------------------------------------------------------------

    def resolve(self, index: MetadataIndex) -> torch.Tensor | io.BytesIO:
        """The data DCP writes for ``index``: staged, the fence's copy, or the live tensor (now
        in flight until :meth:`written`)."""
        item = self.items.get(index)
        if item is None:
            data = self.staged.pop(index)
            if isinstance(data, io.BytesIO):
                data.seek(0)
            return data
        with self._cond:
            if item.copy is not None:
                return item.copy
            item.state = IN_FLIGHT
            return item.live

    def written(self, index: MetadataIndex) -> None:
        """DCP finished serializing item ``index``: its source is no longer read."""
        item = self.items.get(index)
        if item is None:
            return
        with self._cond:
            item.state, item.copy = DONE, None
            self._cond.notify_all()

    def end(self) -> None:
        """The save is over (written or failed): wake any fence, give the arena back."""
        with self._cond:
            self._ended = True
            self.staged.clear()
            self._cond.notify_all()
        self._staging.release(self)

    def planner(self) -> SavePlanner:
        """What DCP's writer resolves items through."""
        return _FencedPlanner(self)

    def transforms(self) -> _StorageWriterTransforms:
        """What tells this fence that DCP's writer finished an item."""
        return _Transforms(self)

    # ---- training-thread side -------------------------------------------------------------

    def protect(self, owner: int) -> None:
        """Make the save independent of what optimizer ``owner`` is about to change (and of
        the items no fenced optimizer owns): copy the waiting ones, wait for those in flight
        (and for waiting ones the arena cannot hold) to be written. Blocks."""
        def todo() -> list[_Item]:
            return [it for it in self.order if it.state != DONE and it.copy is None
                    and (it.owner is None or it.owner == owner)]

        with self._cond:
            if self._ended or not any(it.state == WAITING for it in todo()):
                self._wait(todo())
                return
        need = sum(align_up(it.live.nbytes, ALIGN) for it in self.order)
        arena = self._staging.acquire(self, need)  # not under our lock: may wait for another holder
        with self._cond:
            if self._ended:
                return
            left = todo()
            copy, copied = ParallelCopy(), 0
            for it in reversed(left):  # the writer reaches these last
                n = align_up(it.live.nbytes, ALIGN)
                if it.state != WAITING or arena is None or self._used + n > arena.numel():
                    continue
                dst = _slot(arena[self._used:self._used + it.live.nbytes], it.live)
                if it.live.is_contiguous():
                    copy.add(cast_to_byte_tensor(dst), cast_to_byte_tensor(it.live))
                else:
                    dst.copy_(it.live)
                it.copy = dst
                self._used += n
                copied += it.live.nbytes
            copy.finish()
            self.copied_bytes += copied
            rest = [it for it in left if it.copy is None]
            if any(it.state == WAITING for it in rest):
                log.debug("deepnvme.CheckpointManager: fence staging (%s bytes) holds %d of %d items to "
                          "protect; the step waits for the others to be written", self._staging.budget,
                          len(left) - len(rest), len(left))
            self._wait(rest)

    def _wait(self, items: list[_Item]) -> None:
        """Under the lock: until every one of ``items`` is done or copied, or the save ended."""
        while not self._ended and any(it.state != DONE and it.copy is None for it in items):
            self._cond.wait()


class _FencedPlanner(StagedPlanner):
    """Hands DCP's writer the fence's data in place of a snapshot."""

    def __init__(self, fence: ShareFence) -> None:
        super().__init__({})
        self.fence = fence

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        return self.fence.resolve(write_item.index)


class _Closing(io.IOBase):
    """The stream DCP writes one item into; closing it (DCP does after the item) tells the fence."""

    def __init__(self, inner: IO[bytes], done: Any) -> None:
        super().__init__()
        self.inner, self.done = inner, done

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.inner.write(b)

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.inner.close()
        finally:
            super().close()
            self.done()


class _Transforms(_StorageWriterTransforms):
    """DCP's (empty) stream transforms, with each item's stream reporting its end to the fence."""

    def __init__(self, fence: ShareFence) -> None:
        super().__init__(())
        self.fence = fence

    def transform_save_stream(self, write_item: WriteItem, raw_stream: io.IOBase) -> tuple[IO[bytes], list[str]]:
        inner, descriptors = super().transform_save_stream(write_item, raw_stream)
        index = write_item.index
        return _Closing(inner, lambda: self.fence.written(index)), descriptors  # type: ignore[return-value]


class ShareFences:
    """The fenced saves of one multi-rank manager: the step pre-hooks on the state's optimizers,
    the staging arena and the cost counters. The caller's thread stages (the writer thread, for a
    held save); hooks run on the caller's thread."""

    def __init__(self, *, staging_bytes: int | None) -> None:
        self._staging = Staging(staging_bytes)
        self._hooks: dict[int, Any] = {}
        self._pending: list[ShareFence] = []
        self._gates: list[threading.Event] = []  # saves held for the writer thread's staging
        self._lock = threading.Lock()
        self.fence_wait = 0.0
        self.copied_bytes = 0

    def stage(self, planner: SavePlanner, plan: SavePlan, state: Mapping[str, Any]) -> ShareFence:
        """This rank's share of ``plan`` as a :class:`ShareFence`: plain data and small tensors
        copied now, large ones left live; the optimizers in ``state`` hooked. ``ValueError``
        naming the item for a tensor not on the CPU."""
        optimizers = self.hook(state)
        owners: dict[int, int] = {}
        for opt in optimizers:
            for cdata in _storages(opt):
                owners.setdefault(cdata, id(opt))
        staged: dict[MetadataIndex, torch.Tensor | io.BytesIO] = {}
        items: list[_Item] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO or not isinstance(data, torch.Tensor):
                staged[item.index] = data
                continue
            data = data.detach()
            if data.device.type != "cpu":
                raise ValueError(f"CheckpointManager(staging='fenced') writes from live CPU tensors; "
                                 f"{item.index.fqn!r} is on {data.device}: use staging='snapshot'")
            if data.nbytes < SMALL:
                staged[item.index] = data.clone()
            else:
                items.append(_Item(item.index, data, owners.get(data.untyped_storage()._cdata)))
        fence = ShareFence(staged, items, self._staging)
        with self._lock:
            self._pending.append(fence)
        return fence

    def hook(self, state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
        """Put the fence's step pre-hook on each optimizer in ``state`` (once); the optimizers."""
        optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
        for opt in optimizers:
            if id(opt) not in self._hooks:
                self._hooks[id(opt)] = opt.register_step_pre_hook(self._fence)
        return optimizers

    def hold(self, state: Mapping[str, Any]) -> threading.Event:
        """A save whose share the writer thread will stage (:meth:`stage` there): the optimizers in
        ``state`` hooked now, and their next step waits until the returned event is set (by
        :meth:`release`, once the fence is staged or the save failed)."""
        self.hook(state)
        gate = threading.Event()
        with self._lock:
            self._gates.append(gate)
        return gate

    def release(self, gate: threading.Event) -> None:
        """The writer thread: the held save is staged (or failed); steps need not wait for it."""
        gate.set()
        with self._lock:
            if gate in self._gates:
                self._gates.remove(gate)

    def ended(self, fence: ShareFence) -> None:
        """The writer thread: ``fence``'s save is over."""
        fence.end()
        with self._lock:
            if fence in self._pending:
                self._pending.remove(fence)
            self.copied_bytes += fence.copied_bytes

    def _fence(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._lock:
            gates = list(self._gates)
        if not gates and not self._pending:
            return
        start = time.perf_counter()
        for gate in gates:  # held saves: their fences staged first
            gate.wait()
        with self._lock:
            pending = list(self._pending)
        for fence in pending:
            fence.protect(id(optimizer))
        self.fence_wait += time.perf_counter() - start

    def copied(self) -> int:
        """Bytes the fences copied so far (ended saves and pending ones)."""
        with self._lock:
            return self.copied_bytes + sum(f.copied_bytes for f in self._pending)

    def close(self) -> None:
        """Remove the hooks and free the arena (every save ended by now). Idempotent."""
        with self._lock:
            for gate in self._gates:  # a held save whose writer call never ran
                gate.set()
            self._gates.clear()
        for hook in self._hooks.values():
            hook.remove()
        self._hooks.clear()
        self._staging.close()
