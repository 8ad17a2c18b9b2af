"""Files sent between ranks of a manager over its gloo group, in chunks of ``uint8`` tensors.

Replication and restore need a rank's files on another node without shared storage: the sender
reads a file chunk by chunk and sends each chunk (``torch.distributed.isend``); the receiver
knows every file's size in advance (from the step's manifest), so both sides walk the same
sequence of chunks and no header is exchanged. A file may travel in part: only the given byte
ranges are sent, and the receiver's copy is a sparse file of the full size holding just them.
A local failure (a file that cannot be read or
written) does not break the sequence: the sender sends zeros, the receiver drops what it gets,
and the error is returned for the ranks' vote, so no rank is left waiting. Memory: one send and
one receive buffer of ``chunk`` bytes per call.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CHUNK", "Ranges", "Transfer", "exchange", "link_or_copy"]

CHUNK = 16 << 20  # bytes per message


Ranges = list[tuple[int, int]]  # (offset, length) byte ranges of a file, ascending, disjoint


class Transfer:
    """One direction of an exchange: ``peer`` (a global rank) and the ``(path, size)`` files it
    sends or receives, in order; ``ranges``: per file, the byte ranges that travel (None, or a
    None entry: the whole file)."""

    def __init__(self, peer: int, files: list[tuple[str, int]], ranges: list[Ranges | None] | None = None) -> None:
        self.peer = peer
        self.files = files
        self.ranges: list[Ranges | None] = ranges if ranges is not None else [None] * len(files)

    @property
    def nbytes(self) -> int:
        """Bytes that travel."""
        return sum(size if spans is None else sum(n for _, n in spans)
                   for (_, size), spans in zip(self.files, self.ranges))


def _chunks(transfer: Transfer | None, chunk: int) -> Iterator[tuple[int, int, int]]:
    """``(file index, offset, length)`` of every chunk of ``transfer``'s files, in order."""
    if transfer is None:
        return
    for i, ((_, size), spans) in enumerate(zip(transfer.files, transfer.ranges)):
        for start, length in [(0, size)] if spans is None else spans:
            for offset in range(start, start + length, chunk):
                yield i, offset, min(chunk, start + length - offset)


class _Reader:
    """Reads chunks of the outgoing files; after a failure, zeros (the error is kept)."""

    def __init__(self, files: list[tuple[str, int]]) -> None:
        self.files, self._fd, self._at = files, -1, -1
        self.error: BaseException | None = None

    def read(self, index: int, offset: int, length: int) -> torch.Tensor:
        if self.error is None:
            try:
                if index != self._at:
                    self.close()
                    self._fd, self._at = os.open(self.files[index][0], os.O_RDONLY | os.O_CLOEXEC), index
                data = os.pread(self._fd, length, offset)
                if len(data) != length:
                    raise OSError(f"{self.files[index][0]!r} is shorter than {offset + length} bytes")
                return torch.frombuffer(bytearray(data), dtype=torch.uint8)
            except OSError as exc:
                self.error = exc
        return torch.zeros(length, dtype=torch.uint8)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _Sink:
    """Writes received chunks into the incoming files (each created at the start, of its full
    size: sparse where only ranges come); after a failure, drops them (the error is kept)."""

    def __init__(self, files: list[tuple[str, int]]) -> None:
        self.files, self._fd, self._at = files, -1, -1
        self.error: BaseException | None = None
        try:
            for path, size in files:
                if path != os.devnull:
                    with open(path, "wb") as out:
                        out.truncate(size)
        except OSError as exc:
            self.error = exc

    def write(self, index: int, offset: int, data: torch.Tensor) -> None:
        if self.error is not None:
            return
        try:
            if index != self._at:
                self.close()
                flags = os.O_WRONLY | os.O_CLOEXEC
                self._fd, self._at = os.open(self.files[index][0], flags, 0o644), index
            view = data.numpy().data.cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], offset + done)
        except OSError as exc:
            self.error = exc

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.fsync(fd)
            os.close(fd)


def exchange(group: Any, *, send: Transfer | None, receive: Transfer | None,
             chunk: int = CHUNK) -> BaseException | None:
    """Send ``send``'s files to its peer while receiving ``receive``'s files from its peer
    (either may be None), chunk by chunk; blocks until both are done. Returns this rank's
    local error (None: every byte read and written), never raising one, so that the ranks can
    vote on it; a peer that stops answering surfaces as the group's timeout (``RuntimeError``)."""
    outgoing = list(_chunks(send, chunk))
    incoming = list(_chunks(receive, chunk))
    reader = _Reader(send.files if send is not None else [])
    sink = _Sink(receive.files if receive is not None else [])
    try:
        for n in range(max(len(outgoing), len(incoming))):
            works: list[Any] = []
            if n < len(incoming) and receive is not None:
                buf = torch.empty(incoming[n][2], dtype=torch.uint8)
                works.append(dist.irecv(buf, src=receive.peer, group=group))
            if n < len(outgoing) and send is not None:
                works.append(dist.isend(reader.read(*outgoing[n]), dst=send.peer, group=group))
            for work in works:
                work.wait()
            if n < len(incoming):
                sink.write(incoming[n][0], incoming[n][1], buf)
    finally:
        reader.close()
        try:
            sink.close()
        except OSError as exc:
            sink.error = sink.error or exc
    return reader.error or sink.error


def link_or_copy(src: str, dst: str) -> None:
    """``dst`` as a second name of the committed (never rewritten) file ``src``, or a copy where
    hard links do not work (another filesystem)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
