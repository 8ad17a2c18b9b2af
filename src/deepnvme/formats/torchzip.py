"""Checkpoint layouts as pure data: where each storage's bytes live in a torch.save zip file.

A ``torch.save`` file is an uncompressed zip archive: ``<archive>/data.pkl`` (the pickled
object, tensors as persistent ids), ``<archive>/data/<key>`` (one record per storage, its raw
bytes), plus small records. The standard library's :mod:`zipfile` reads the central directory
(zip64 included); the data of a record starts after its local header, whose name and extra
field lengths are read from the file. Nothing here moves tensor bytes.
"""

from __future__ import annotations

import dataclasses
import struct
import zipfile
from collections.abc import Mapping, Sequence
from typing import IO

from ..errors import CheckpointFormatError

__all__ = ["ZIP_MAGIC", "RecordSpan", "Piece", "read_record_spans", "storage_spans",
           "split_by_bytes", "split_byte_ranges", "check_sizes", "batch_small_records",
           "STORAGE_ALIGNMENT", "SMALL_RECORD", "MAX_BATCH"]

ZIP_MAGIC = b"PK\x03\x04"   # the first bytes of a torch.save file (a zip archive)

STORAGE_ALIGNMENT = 4096
"""Alignment (bytes) of every storage record's data in files deepnvme writes (O_DIRECT-ready)."""

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50


@dataclasses.dataclass(frozen=True)
class RecordSpan:
    """One zip record: ``name`` without the archive prefix, data ``offset`` and ``size`` in bytes."""

    name: str
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


def read_record_spans(fileobj: IO[bytes], *, path: str, file_size: int) -> dict[str, RecordSpan]:
    """Locate every record's data in an open torch.save zip file (central directory + local headers).

    Raises :class:`CheckpointFormatError` for a file that is not a zip, is compressed, is
    truncated (a record ends past ``file_size``) or has an inconsistent local header.
    """
    try:
        archive = zipfile.ZipFile(fileobj)
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise CheckpointFormatError(f"{path!r} is not a readable torch.save zip file "
                                    f"(truncated or corrupted?): {exc}") from None
    spans: dict[str, RecordSpan] = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointFormatError(f"{path!r}: record {info.filename!r} is compressed; "
                                        "torch.save files store records uncompressed")
        fileobj.seek(info.header_offset)
        raw = fileobj.read(_LOCAL_HEADER.size)
        if len(raw) != _LOCAL_HEADER.size:
            raise CheckpointFormatError(f"{path!r}: local header of {info.filename!r} at offset "
                                        f"{info.header_offset} is cut off (file truncated)")
        fields = _LOCAL_HEADER.unpack(raw)
        if fields[0] != _LOCAL_SIG:
            raise CheckpointFormatError(f"{path!r}: bad local header signature for "
                                        f"{info.filename!r} at offset {info.header_offset}")
        name_len, extra_len = fields[9], fields[10]
        offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        span = RecordSpan(_strip_archive(info.filename), offset, info.file_size)
        if span.end > file_size:
            raise CheckpointFormatError(
                f"{path!r}: record {info.filename!r} needs bytes {span.offset}..{span.end} but "
                f"the file has {file_size} bytes (truncated)")
        spans[span.name] = span
    if "data.pkl" not in spans:
        raise CheckpointFormatError(f"{path!r} has no data.pkl record: not a torch.save file")
    return spans


def _strip_archive(name: str) -> str:
    head, sep, rest = name.partition("/")
    return rest if sep else head


def storage_spans(spans: Mapping[str, RecordSpan]) -> dict[str, RecordSpan]:
    """The storage records only, keyed by storage key (``"0"``, ``"1"``, ...)."""
    return {name[5:]: span for name, span in spans.items() if name.startswith("data/")}


def split_by_bytes(sizes: Mapping[str, int], parts: int) -> list[list[str]]:
    """Split keys into ``parts`` groups of nearly equal total bytes (largest first, greedy).

    Deterministic for the same input, so every rank computes the same split on its own.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    groups: list[list[str]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        i = min(range(parts), key=lambda j: (totals[j], j))
        groups[i].append(key)
        totals[i] += sizes[key]
    return groups


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes ``[start, start + length)`` of storage ``key``, to be written at ``file_offset``."""

    key: str
    start: int
    length: int
    file_offset: int


def split_byte_ranges(spans: Mapping[str, RecordSpan], parts: int, *,
                      alignment: int = STORAGE_ALIGNMENT) -> list[list[Piece]]:
    """Cut the storages' bytes (in file order) into ``parts`` nearly equal contiguous shares.

    Cuts fall on multiples of ``alignment`` inside a storage, so with aligned records every
    piece starts O_DIRECT-aligned. Deterministic: every rank computes the same plan.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    ordered = sorted(spans.items(), key=lambda kv: kv[1].offset)
    starts, base = [], 0
    for _, span in ordered:
        starts.append(base)
        base += span.size
    total = base
    bounds = [0]
    for i in range(1, parts):
        target = total * i // parts
        j = max((k for k, st in enumerate(starts) if st <= target), default=0)
        rel = (target - starts[j]) // alignment * alignment if ordered else 0
        bounds.append(max(bounds[-1], starts[j] + rel if ordered else 0))
    bounds.append(total)
    shares: list[list[Piece]] = [[] for _ in range(parts)]
    base = 0
    for key, span in ordered:
        for rank in range(parts):
            lo = max(bounds[rank], base)
            hi = min(bounds[rank + 1], base + span.size)
            if hi > lo:
                shares[rank].append(Piece(key, lo - base, hi - lo, span.offset + lo - base))
        base += span.size
    return shares


SMALL_RECORD = 256 * 1024
"""Records smaller than this (bytes) are moved in batches: one request per run of them."""
MAX_BATCH = 16 << 20
"""Most bytes (records and the zip headers between them) one batched request covers."""


def batch_small_records(spans: Mapping[str, RecordSpan], *, small: int = SMALL_RECORD,
                        max_batch: int = MAX_BATCH) -> list[list[str]]:
    """Group keys, in file order, into runs of small records that one request can cover.

    A large record is a group of its own; a run of small ones is cut when the region from its
    first record's data to its last record's end would exceed ``max_batch``. Each request then
    moves ``[first.offset, last.end)``: the records plus the zip headers between them.
    """
    groups: list[list[str]] = []
    run: list[str] = []
    for key, span in sorted(spans.items(), key=lambda kv: kv[1].offset):
        if span.size >= small:
            if run:
                groups.append(run)
                run = []
            groups.append([key])
            continue
        if run and span.end - spans[run[0]].offset > max_batch:
            groups.append(run)
            run = []
        run.append(key)
    if run:
        groups.append(run)
    return groups


def check_sizes(spans: Mapping[str, RecordSpan], nbytes: Mapping[str, int], *, path: str) -> None:
    """Every storage key must have a record of exactly its byte size (and no extra records)."""
    missing = sorted(set(nbytes) - set(spans))
    extra = sorted(set(spans) - set(nbytes))
    if missing or extra:
        raise CheckpointFormatError(f"{path!r}: storage records {sorted(spans)} do not match the "
                                    f"storages pickled (missing {missing}, unexpected {extra})")
    for key, n in nbytes.items():
        if spans[key].size != n:
            raise CheckpointFormatError(f"{path!r}: record data/{key} holds {spans[key].size} "
                                        f"bytes but its storage has {n}")


def total_bytes(spans: Sequence[RecordSpan]) -> int:
    return sum(s.size for s in spans)
