"""Batches: many ``(address, size, file_offset, keepalive)`` items of one file, opened once,
turned into the engine's requests (:meth:`Engine.submit_many`).

Items that are one aligned O_DIRECT chunk each (the small random reads of data loading and
weight streaming) are gathered, :data:`GATHER` to a request whose chunks carry absolute
addresses, so a hundred thousand 4 KiB reads cost a few microseconds of Python each; other
items get a request of their own, planned like any other. Plain tuples rather than
:class:`Transfer` objects come in: only the items that need planning get a Transfer.
"""

from __future__ import annotations

import errno
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ..errors import DeepNVMeIOError, ShortTransferError
from .op import Batch, Op, Transfer
from .plan import PAGE_SIZE, Alignment, Chunk, Kind, plan_transfer

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["submit_many", "GATHER"]

GATHER = 256  # single-chunk items gathered into one request
Item = tuple[int, int, int, Any]  # address, size, file_offset, keepalive


def submit_many(engine: "Engine", write: bool, target: str, items: list[Item], *,
                validate: bool, fsync: bool) -> Future[int]:
    """Start the batch; the future's result is the total byte count, or the first failure once
    every item has ended. ``fsync`` (writes) runs once, after the last item."""
    engine._workers.check_open()
    if not items:
        done: Future[int] = Future()
        done.set_result(0)
        return done
    address, size, offset, keep = items[0]
    batch = Batch(Transfer(write=write, address=address, size=size, target=target,
                           file_offset=offset, keepalive=keep), validate, fsync)
    batch.future.set_running_or_notify_cancel()
    try:
        alignment = _open(engine, batch, items)
    except BaseException as exc:  # every failure goes to the future
        batch.close_fds(engine.posix)
        batch.future.set_exception(exc)
        return batch.future
    gathered, single = _split(items, alignment, engine.config.block_size, validate)
    ops = [_gathered(batch, gathered[i:i + GATHER]) for i in range(0, len(gathered), GATHER)]
    ops += [_member(engine, batch, Transfer(write=write, address=a, size=n, target=target,
                                            file_offset=o, keepalive=k), validate, alignment)
            for a, n, o, k in single]
    batch.remaining = len(ops)
    # planned first, admitted at once: planning while workers run only makes the two fight
    # over the GIL (measured slower for 100k small reads)
    engine._admit(ops, batch)
    return batch.future


def _split(items: list[Item], alignment: Alignment | None, block: int, validate: bool
           ) -> tuple[list[Item], list[Item]]:
    """(items that are one aligned direct chunk each, the rest)."""
    if alignment is None or validate:
        return [], items
    edge, mem = max(alignment.offset, PAGE_SIZE), alignment.memory
    gathered, single = [], []
    for item in items:
        address, size, offset, _ = item
        if 0 < size <= block and not (offset % edge or size % edge or address % mem):
            gathered.append(item)
        else:
            single.append(item)
    return gathered, single


def _member(engine: "Engine", batch: Batch, t: Transfer, validate: bool,
            alignment: Alignment | None) -> Op:
    op = Op(t, validate, False, batch=batch)
    op.chunks = plan_transfer(size=t.size, file_offset=t.file_offset, address=t.address,
                              block_size=engine.config.block_size, alignment=alignment)
    op.fd_direct, op.fd_buffered, op.remaining = batch.fd_direct, batch.fd_buffered, len(op.chunks)
    return op


def _gathered(batch: Batch, part: list[Item]) -> Op:
    """One request over many single-chunk items: its chunks' ``buf_offset`` are absolute
    addresses (the request's own address is 0) and it keeps the items' buffers alive."""
    first = batch.transfer
    carrier = Transfer(write=first.write, address=0, size=sum(item[1] for item in part),
                       target=first.target, file_offset=part[0][2], keepalive=part)
    op = Op(carrier, False, False, batch=batch)
    direct = Kind.DIRECT
    op.chunks = [Chunk(a, o, n, direct) for a, n, o, _ in part]
    op.fd_direct, op.fd_buffered, op.remaining = batch.fd_direct, batch.fd_buffered, len(op.chunks)
    return op


def _open(engine: "Engine", batch: Batch, items: list[Item]) -> Alignment | None:
    """Check every item, open the file once (both descriptors where edges need the buffered
    one) and return the O_DIRECT alignment."""
    first = batch.transfer
    for _, size, offset, _ in items:
        if offset < 0:
            raise DeepNVMeIOError("negative file offset", path=first.name, offset=offset,
                                  size=size, errno=errno.EINVAL)
    alignment = engine._open(batch)
    if not first.write:
        fd = batch.fd_direct if batch.fd_direct >= 0 else batch.fd_buffered
        _check_inside(first.name, items, engine.posix.file_size(fd))
    if batch.fd_buffered < 0 and alignment is not None:
        edge = max(alignment.offset, PAGE_SIZE)
        if any(offset % edge or size % edge for _, size, offset, _ in items):
            batch.fd_buffered = engine._reopen_buffered(batch)
    return alignment


def _check_inside(name: str, items: list[Item], file_size: int) -> None:
    for _, size, offset, _ in items:
        if offset + size > file_size:
            raise ShortTransferError(
                f"read past end of file: the file has {file_size} bytes but the request ends "
                f"at {offset + size}", path=name, offset=offset, size=size, transferred=0)
