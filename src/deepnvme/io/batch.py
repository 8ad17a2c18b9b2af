"""Batches: many items (address, size, file_offset) of one file, opened once, turned into
the engine's requests (:meth:`Engine.submit_many`).

Items that are one aligned O_DIRECT chunk each (the small random reads of data loading and
weight streaming) are gathered, :data:`GATHER` to a request whose chunks carry absolute
addresses and are made only when the engine hands them out; other items get a request of
their own, planned like any other. Items come as three lists of ints, not an object each:
a hundred thousand objects that survive planning make the garbage collector walk the whole
heap several times, a large share of a batch's time.
"""

from __future__ import annotations

import errno
import operator
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..errors import DeepNVMeIOError, ShortTransferError
from .op import Batch, Gathered, Op, Transfer
from .plan import PAGE_SIZE, Alignment, plan_transfer

if TYPE_CHECKING:
    from .opening import Opener
    from .window import Window

__all__ = ["submit_many", "GATHER", "Items", "Route", "Small", "Summary", "summarize", "small_shape"]

GATHER = 256  # single-chunk items gathered into one request


#: ``small(batch, items, (end, largest, uniform))``: runs an opened batch of small direct reads
#: (:func:`small_shape`) and returns True, or declines it (False); it may raise (the batch's error)
Small = Callable[["Batch", "Items", "tuple[int, int, int]"], bool]

#: ``route(batch, direct=, end=, largest=)``: the window that runs a planned batch (the engine's
#: :meth:`~deepnvme.io.engine.Engine.mover_for`); it may raise (the batch's error)
Route = Callable[..., "Window"]


class Summary(NamedTuple):
    """Bounds of a batch's items computed in bulk by a caller that holds them as tensors, so
    that planning needs no loop per item where all of them are gathered: the smallest offset,
    the end (largest offset + size), the smallest and largest size, and the largest power of
    two (at most 2**62) dividing every offset and size (``offset_align``) and every address
    (``address_align``)."""

    lowest: int
    end: int
    smallest: int
    largest: int
    offset_align: int
    address_align: int


_PIECE = 8192  # 3 columns stacked stay below ATen's parallel grain (32768 elements): one thread


def summarize(at: torch.Tensor, base: int, offsets: torch.Tensor, sizes: torch.Tensor
              ) -> tuple[Summary, list[int], int, int, torch.Tensor]:
    """Ranges of one buffer at address ``base`` (1-D int64 tensors of one length, not empty:
    buffer offsets ``at``, file ``offsets``, ``sizes``): their :class:`Summary`, their absolute
    addresses as a list and as a tensor, and the lowest and highest buffer byte they reach
    (``at`` and ``at + sizes``). Computed a piece at a time below ATen's grain, the bounds of
    a piece in three reductions over stacked columns: a parallel reduction waits for the
    intra-op pool, milliseconds per call on a busy machine (measured 12 ms for a minimum of
    65,536 ints, 25 us on one thread), and each tensor call costs microseconds however small."""
    absolute = at + base
    addresses: list[int] = []
    parts = []
    pieces = ((at, offsets, sizes, absolute),) if at.numel() <= _PIECE else zip(
        at.split(_PIECE), offsets.split(_PIECE), sizes.split(_PIECE), absolute.split(_PIECE))
    for a, o, s, b in pieces:  # (Tensor.split alone costs ~10 us a call)
        addresses += b.tolist()
        low = torch.stack([o | s, b])
        low &= -low  # each value's lowest set bit; 0 (divisible by anything) counts as 2**62
        low.masked_fill_(low == 0, 1 << 62)
        o_min, s_min, a_min, o_align, b_align = torch.cat(
            [torch.stack([o, s, a]).amin(1), low.amin(1)]).tolist()
        end, s_max, a_end = torch.stack([o + s, s, a + s]).amax(1).tolist()
        parts.append((o_min, end, s_min, s_max, o_align, b_align, a_min, a_end))
    low_ = [min(column) for column in zip(*parts)]
    high = [max(column) for column in zip(*parts)]
    summary = Summary(low_[0], high[1], low_[2], high[3], low_[4], low_[5])
    return summary, addresses, low_[6], high[7], absolute


class Items:
    """A batch's items: ``addresses``, ``sizes`` and ``file_offsets`` (equal-length lists of
    ints) and ``keepalive``, held until the batch completes (the buffers' owners);
    ``summary``, where the caller computed it (:func:`summarize`), must be exact, as must
    ``tensors``: the same addresses, offsets and sizes as 1-D int64 tensors, where the caller
    has them (small reads build their entries from them)."""

    __slots__ = ("addresses", "sizes", "offsets", "keepalive", "summary", "tensors")

    def __init__(self, addresses: list[int], sizes: list[int], offsets: list[int],
                 keepalive: Any, summary: Summary | None = None,
                 tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        if not len(addresses) == len(sizes) == len(offsets):
            raise ValueError("addresses, sizes and offsets must have the same length")
        self.addresses, self.sizes, self.offsets = addresses, sizes, offsets
        self.keepalive = keepalive
        self.summary = summary
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.addresses)


def submit_many(opener: Opener, route: Route, block_size: int, write: bool, target: str,
                items: Items, *, validate: bool, fsync: bool,
                keep_open: bool = False, small: Small | None = None,
                small_max: int = 0) -> Future[int]:
    """Start the batch: open ``target`` with ``opener``, plan chunks of at most ``block_size``
    bytes, admit them to the window ``route`` gives. The future's result is the total byte count, or the first
    failure once every item has ended. ``fsync`` (writes) runs once, after the last item.
    ``keep_open`` uses the opener's kept descriptors of ``target`` (see
    :meth:`Engine.submit <deepnvme.io.engine.Engine.submit>`). ``small`` may take a batch of
    direct reads of at most ``small_max`` bytes each instead (:func:`small_shape`)."""
    if not len(items):
        done: Future[int] = Future()
        done.set_result(0)
        return done
    batch = Batch(Transfer(write=write, address=items.addresses[0], size=items.sizes[0],
                           target=target, file_offset=items.offsets[0],
                           keepalive=items.keepalive), validate, fsync)
    batch.future.set_running_or_notify_cancel()
    try:
        alignment = opener.open(batch, keep_open)
        if small is not None and not write and not validate and alignment is not None:
            small_read = small_shape(items, alignment, min(block_size, small_max))
            if small_read is not None:
                _check_inside(batch.transfer.name, items, small_read[0],
                              opener.posix.file_size(batch.fd_direct))
                if small(batch, items, small_read):
                    return batch.future
        ops, shape = _plan(opener, block_size, batch, items, alignment, validate)
        window = route(batch, **shape)
    except BaseException as exc:  # every failure goes to the future
        batch.close_fds(opener.posix)
        batch.future.set_exception(exc)
        return batch.future
    batch.remaining = len(ops)
    # planned first, admitted at once: planning while workers run only makes the two fight
    # over the GIL (measured slower for 100k small reads)
    window.admit(ops, batch)
    return batch.future


def small_shape(items: Items, alignment: Alignment, limit: int) -> tuple[int, int, int] | None:
    """``(end, largest, uniform)`` of a batch whose items are all one aligned direct chunk of
    at most ``limit`` bytes (``end``: the file offset the last byte reaches, ``uniform``: the
    size of every item, or 0 if they differ), else None; from the summary where there is one."""
    edge, mem = max(alignment.offset, PAGE_SIZE), alignment.memory
    s = items.summary
    if s is not None:
        if (s.lowest < 0 or s.smallest <= 0 or s.largest > limit or s.offset_align % edge
                or s.address_align % mem):
            return None
        return s.end, s.largest, s.largest if s.smallest == s.largest else 0
    sizes, offsets, addresses = items.sizes, items.offsets, items.addresses
    smallest, largest = min(sizes), max(sizes)
    if (smallest <= 0 or largest > limit or min(offsets) < 0 or any(o % edge for o in offsets)
            or any(n % edge for n in sizes) or any(a % mem for a in addresses)):
        return None
    return max(map(operator.add, offsets, sizes)), largest, largest if smallest == largest else 0


def _plan(opener: Opener, block_size: int, batch: Batch, items: Items,
          alignment: Alignment | None, validate: bool) -> tuple[list[Op], dict[str, Any]]:
    """Check every item and plan the batch's requests in one pass (this runs before the first
    transfer starts, so its cost per item is the batch's latency); also the batch's shape for
    the engine's choice of mover (``direct``, ``end``, ``largest``)."""
    first = batch.transfer
    gather = alignment is not None
    edge = max(alignment.offset, PAGE_SIZE) if alignment is not None else PAGE_SIZE
    mem = alignment.memory if alignment is not None else 1
    addresses, sizes, offsets = items.addresses, items.sizes, items.offsets
    picked: list[int] = []
    single: list[int] = []
    end, largest, ragged = 0, 0, False
    s = items.summary
    if (s is not None and gather and s.lowest >= 0 and 0 < s.smallest and s.largest <= block_size
            and s.offset_align % edge == 0 and s.address_align % mem == 0):
        end, largest = s.end, s.largest  # every item is gathered: no loop per item
        gathered: list[int] | range = range(len(addresses))
    else:
        for j in range(len(addresses)):
            size, offset = sizes[j], offsets[j]
            if offset < 0:
                raise DeepNVMeIOError("negative file offset", path=first.name, offset=offset,
                                      size=size, errno=errno.EINVAL)
            if offset + size > end:
                end = offset + size
            if size > largest:
                largest = size
            if offset % edge or size % edge:
                ragged = True
                single.append(j)
            elif gather and 0 < size <= block_size and not addresses[j] % mem:
                picked.append(j)
            else:
                single.append(j)
        # all of them (consecutive, sliced per request) or those picked
        gathered = range(len(addresses)) if len(picked) == len(addresses) else picked
    if not first.write:
        fd = batch.fd_direct if batch.fd_direct >= 0 else batch.fd_buffered
        _check_inside(first.name, items, end, opener.posix.file_size(fd))
    if ragged and batch.fd_buffered < 0 and alignment is not None:
        batch.fd_buffered = opener.reopen_buffered(batch)
    ops = [_gathered(batch, items, gathered[i:i + GATHER], validate)
           for i in range(0, len(gathered), GATHER)]
    ops += [_member(block_size, batch, Transfer(write=first.write, address=addresses[j],
                                                size=sizes[j], target=first.target,
                                                file_offset=offsets[j],
                                                keepalive=items.keepalive),
                    validate, alignment) for j in single]
    shape = {"direct": alignment is not None and not ragged, "end": end,
             "largest": min(largest, block_size)}
    return ops, shape


def _member(block_size: int, batch: Batch, t: Transfer, validate: bool,
            alignment: Alignment | None) -> Op:
    op = Op(t, validate, False, batch=batch)
    op.chunks = plan_transfer(size=t.size, file_offset=t.file_offset, address=t.address,
                              block_size=block_size, alignment=alignment)
    op.fd_direct, op.fd_buffered, op.remaining = batch.fd_direct, batch.fd_buffered, len(op.chunks)
    return op


def _gathered(batch: Batch, items: Items, index: list[int] | range, validate: bool) -> Op:
    """One request over many single-chunk items (``index``, consecutive ones as a range):
    its chunks hold absolute addresses (the request's own address is 0); the batch keeps the
    buffers alive. ``validate`` compares each item with the file once all have ended."""
    first = batch.transfer
    if type(index) is range and index.step == 1:  # consecutive items: slices, no loop per item
        a, b = index.start, index.stop
        addresses, offsets, sizes = items.addresses[a:b], items.offsets[a:b], items.sizes[a:b]
    else:
        addresses = [items.addresses[j] for j in index]
        offsets = [items.offsets[j] for j in index]
        sizes = [items.sizes[j] for j in index]
    carrier = Transfer(write=first.write, address=0, size=sum(sizes), target=first.target,
                       file_offset=offsets[0])
    op = Op(carrier, validate, False, batch=batch)
    op.chunks = Gathered(addresses, offsets, sizes)
    op.fd_direct, op.fd_buffered, op.remaining = batch.fd_direct, batch.fd_buffered, len(sizes)
    return op


def _check_inside(name: str, items: Items, end: int, file_size: int) -> None:
    if end <= file_size:
        return
    for size, offset in zip(items.sizes, items.offsets):  # name the first item past the end
        if offset + size > file_size:
            raise ShortTransferError.past_end(path=name, offset=offset, size=size,
                                              file_size=file_size)
