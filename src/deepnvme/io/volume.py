"""Volumes: several directories, one per drive, used as one striped device (pure layout).

A file on a volume (``vol / "x.bin"``, a :class:`VolumePath`) is striped: its bytes are cut
into units of ``stripe`` bytes dealt round robin over the drives, unit ``u`` to drive
``u % n`` at offset ``(u // n) * stripe`` of that drive's part file. Beside each part lies a
layout record (:class:`VolumeRecord`, JSON) naming every drive in order, the stripe unit, the
logical size, each part's size and an id shared by the parts of one file, so a volume opened
with other paths, another order or stripe unit, or a missing drive is refused instead of
returning wrong bytes. This module only computes: reading and writing records is
:mod:`deepnvme.io.volume_files`, moving bytes :mod:`deepnvme.io.striped`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..config import parse_size
from ..errors import ConfigError, VolumeLayoutError

__all__ = ["Volume", "VolumePath", "PartSpan", "VolumeRecord", "stripe_spans", "part_size",
           "split_ranges", "env_stripe", "STRIPE_MULTIPLE", "RECORD_FORMAT"]

#: the stripe unit is a multiple of this, so an aligned logical offset stays aligned in a part
STRIPE_MULTIPLE = 4096
RECORD_FORMAT = "deepnvme-volume"
_RECORD_VERSION = 1


def env_stripe(environ: Mapping[str, str] | None = None) -> str:
    """The stripe unit ``DEEPNVME_VOLUME_STRIPE`` names, else ``1M`` (read when called)."""
    env = os.environ if environ is None else environ
    return env.get("DEEPNVME_VOLUME_STRIPE", "").strip() or "1M"


class Volume:
    """Several directories, one per drive, used as one striped device.

    Args:
        paths: one directory per drive, in order (the order is part of every file's layout).
            Created on the first write if missing.
        stripe: the stripe unit, bytes or a size string (``"1M"``, ``"256K"``); a multiple of
            4096 bytes.

    ``vol / "name"`` is a :class:`VolumePath`, accepted by the handles wherever they take a
    file path. A volume is an immutable value: two volumes with the same paths and stripe
    are equal. It touches no file until a request does.
    """

    __slots__ = ("paths", "stripe")

    def __init__(self, paths: Iterable[str | os.PathLike[str]], *,
                 stripe: str | int = "1M") -> None:
        if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
            raise ConfigError("Volume takes a list of directories, one per drive, not one path")
        dirs = tuple(os.path.abspath(os.fspath(p)) for p in paths)
        if not dirs:
            raise ConfigError("a Volume needs at least one directory")
        seen: set[str] = set()
        for d in dirs:
            if d in seen:
                raise ConfigError(f"Volume: directory {d!r} is listed twice")
            seen.add(d)
        unit = parse_size(stripe)
        if unit <= 0 or unit % STRIPE_MULTIPLE:
            raise ConfigError(f"Volume stripe {stripe!r} must be a positive multiple of "
                              f"{STRIPE_MULTIPLE} bytes, e.g. '1M'")
        #: the drive directories, absolute, in stripe order
        self.paths: tuple[str, ...] = dirs
        #: the stripe unit in bytes
        self.stripe: int = unit

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Volume | None:
        """The volume named by ``DEEPNVME_VOLUME`` (its directories, one per drive, joined by
        ``os.pathsep`` as in ``PATH``) and ``DEEPNVME_VOLUME_STRIPE`` (default ``1M``); None
        when ``DEEPNVME_VOLUME`` is unset or empty. For containers whose drives arrive as
        separate mounts: the job's launcher names them once. Read when called, never at import."""
        env = os.environ if environ is None else environ
        listed = env.get("DEEPNVME_VOLUME", "").strip()
        if not listed:
            return None
        dirs = [d for d in listed.split(os.pathsep) if d.strip()]
        stripe = env_stripe(env)
        try:
            return cls(dirs, stripe=stripe)
        except ConfigError as exc:
            raise ConfigError(f"DEEPNVME_VOLUME={listed!r}, DEEPNVME_VOLUME_STRIPE={stripe!r}: {exc}") from None

    def __truediv__(self, name: str | os.PathLike[str]) -> VolumePath:
        return VolumePath(self, os.fspath(name))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Volume) and self.paths == other.paths
                and self.stripe == other.stripe)

    def __hash__(self) -> int:
        return hash((self.paths, self.stripe))

    def __repr__(self) -> str:
        return f"Volume({list(self.paths)!r}, stripe={self.stripe})"


class VolumePath:
    """A striped file of a :class:`Volume`: ``name`` relative to every drive directory.

    Not an ``os.PathLike`` on purpose: a plain ``open()`` of a striped file would read one
    part's bytes; use a handle, :func:`deepnvme.load`, or ``deepnvme volume join``.
    ``path / "x"`` names a file below it.
    """

    __slots__ = ("volume", "name")

    def __init__(self, volume: Volume, name: str) -> None:
        norm = os.path.normpath(name) if name else ""
        if (not norm or os.path.isabs(name) or norm == "." or norm.startswith("..")
                or norm.endswith(".json")):
            raise ConfigError(f"volume file name {name!r} must be a relative path inside the "
                              "volume (no '..', not absolute, not ending in '.json')")
        self.volume = volume
        self.name = norm

    def __truediv__(self, name: str | os.PathLike[str]) -> VolumePath:
        return VolumePath(self.volume, os.path.join(self.name, os.fspath(name)))

    @property
    def drives(self) -> int:
        return len(self.volume.paths)

    def part(self, drive: int) -> str:
        """The part file of ``drive`` (an index into ``volume.paths``)."""
        return os.path.join(self.volume.paths[drive], f"{self.name}.part{drive}")

    def record(self, drive: int) -> str:
        """The layout record beside the part of ``drive``."""
        return os.path.join(self.volume.paths[drive], f"{self.name}.volume.json")

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, VolumePath) and self.volume == other.volume
                and self.name == other.name)

    def __hash__(self) -> int:
        return hash((self.volume, self.name))

    def __str__(self) -> str:
        return f"{self.name} on volume {list(self.volume.paths)}"

    def __repr__(self) -> str:
        return f"VolumePath({self.volume!r}, {self.name!r})"


@dataclasses.dataclass(frozen=True)
class PartSpan:
    """``length`` bytes at ``buf_offset`` of the caller's buffer <-> ``part_offset`` of the
    part file of ``drive``."""

    drive: int
    part_offset: int
    buf_offset: int
    length: int


def stripe_spans(offset: int, length: int, *, drives: int, stripe: int) -> list[PartSpan]:
    """The part spans of logical bytes ``[offset, offset + length)``, in logical order (at
    most one stripe unit each; none for an empty range)."""
    if offset < 0 or length < 0 or drives <= 0 or stripe <= 0:
        raise ValueError(f"bad span: offset {offset}, length {length}, drives {drives}, "
                         f"stripe {stripe}")
    spans: list[PartSpan] = []
    pos, end = offset, offset + length
    while pos < end:
        unit, within = divmod(pos, stripe)
        n = min(stripe - within, end - pos)
        spans.append(PartSpan(drive=unit % drives, part_offset=(unit // drives) * stripe + within,
                              buf_offset=pos - offset, length=n))
        pos += n
    return spans


def split_ranges(addresses: list[int], sizes: list[int], offsets: list[int], *, drives: int,
                 stripe: int) -> list[tuple[list[int], list[int], list[int]]]:
    """:func:`stripe_spans` of many ranges at once: per drive, the (addresses, sizes, part
    offsets) of every range's pieces, in the ranges' order. ``addresses`` are where each range's
    bytes lie in memory (a piece's address moves with it). Tensor arithmetic, no object per
    range: a batch of thousands of small reads (token samples) is split in a few operations."""
    if drives <= 0 or stripe <= 0:
        raise ValueError(f"bad split: drives {drives}, stripe {stripe}")
    off, size, addr = (torch.tensor(v, dtype=torch.int64) for v in (offsets, sizes, addresses))
    if off.numel() and (int(off.min()) < 0 or int(size.min()) < 0):
        k = int(((off < 0) | (size < 0)).nonzero()[0])
        raise ValueError(f"bad span: offset {offsets[k]}, length {sizes[k]}")
    keep = size > 0
    off, size, addr = off[keep], size[keep], addr[keep]
    first = off // stripe
    count = (off + size - 1) // stripe - first + 1
    which = torch.repeat_interleave(torch.arange(off.numel()), count)
    starts = torch.cumsum(count, 0) - count
    unit = first[which] + torch.arange(which.numel()) - torch.repeat_interleave(starts, count)
    lo = torch.maximum(off[which], unit * stripe)
    hi = torch.minimum(off[which] + size[which], (unit + 1) * stripe)
    drive = unit % drives
    part_off = (unit // drives) * stripe + (lo - unit * stripe)
    piece_addr = addr[which] + (lo - off[which])
    out = []
    for d in range(drives):
        mine = drive == d
        out.append((piece_addr[mine].tolist(), (hi - lo)[mine].tolist(), part_off[mine].tolist()))
    return out


def part_size(size: int, drive: int, *, drives: int, stripe: int) -> int:
    """Bytes of a ``size``-byte striped file that live in the part of ``drive``."""
    units, rest = divmod(size, stripe)
    full = units // drives + (1 if drive < units % drives else 0)
    return full * stripe + (rest if units % drives == drive else 0)


@dataclasses.dataclass(frozen=True)
class VolumeRecord:
    """A striped file's layout, the same in every drive's record except ``index``."""

    name: str
    drives: tuple[str, ...]
    index: int
    stripe: int
    size: int
    parts: tuple[int, ...]
    file_id: str

    @classmethod
    def for_size(cls, vpath: VolumePath, size: int, *, index: int, file_id: str) -> VolumeRecord:
        vol = vpath.volume
        n = len(vol.paths)
        return cls(name=vpath.name, drives=vol.paths, index=index, stripe=vol.stripe, size=size,
                   parts=tuple(part_size(size, d, drives=n, stripe=vol.stripe) for d in range(n)),
                   file_id=file_id)

    def to_json(self) -> dict[str, Any]:
        return {"format": RECORD_FORMAT, "version": _RECORD_VERSION, "name": self.name,
                "drives": list(self.drives), "index": self.index, "stripe": self.stripe,
                "size": self.size, "parts": list(self.parts), "file_id": self.file_id}

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> VolumeRecord:
        """Parse a record read from ``where``; a record of another format or version, or with
        fields missing or of the wrong type, raises :class:`VolumeLayoutError`."""
        def bad(why: str) -> VolumeLayoutError:
            return VolumeLayoutError(f"not a deepnvme volume layout record: {why}", path=where)

        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            raise bad("no 'format': 'deepnvme-volume'")
        if data.get("version") != _RECORD_VERSION:
            raise bad(f"version {data.get('version')!r}, this deepnvme reads {_RECORD_VERSION}")
        try:
            rec = cls(name=str(data["name"]), drives=tuple(str(d) for d in data["drives"]),
                      index=_int(data["index"]), stripe=_int(data["stripe"]),
                      size=_int(data["size"]), parts=tuple(_int(p) for p in data["parts"]),
                      file_id=str(data["file_id"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"field {exc} missing or of the wrong type") from None
        if len(rec.parts) != len(rec.drives) or not 0 <= rec.index < len(rec.drives):
            raise bad("'parts' and 'index' do not match 'drives'")
        return rec


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(repr(value))
    return value


def check_records(vpath: VolumePath, records: Sequence[VolumeRecord]) -> VolumeRecord:
    """Check the records read from every drive (in drive order) against the volume they were
    opened with and against each other; return drive 0's. Raises :class:`VolumeLayoutError`
    naming the drive and record file of the first mismatch."""
    vol = vpath.volume
    first = records[0]
    for d, rec in enumerate(records):
        where = vpath.record(d)
        if rec.drives != vol.paths:
            if sorted(rec.drives) == sorted(vol.paths):
                why = (f"the drives are listed in another order: written as "
                       f"{list(rec.drives)}, opened as {list(vol.paths)}")
            else:
                why = (f"written on drives {list(rec.drives)}, opened with "
                       f"{list(vol.paths)}")
            raise VolumeLayoutError(f"volume drive {d} does not match {vpath.name!r}: {why}",
                                    path=where)
        if rec.stripe != vol.stripe:
            raise VolumeLayoutError(f"{vpath.name!r} was striped with stripe={rec.stripe}, the "
                                    f"volume was opened with stripe={vol.stripe}", path=where)
        if rec.index != d or rec.name != vpath.name:
            raise VolumeLayoutError(f"volume drive {d} holds the record of drive {rec.index} "
                                    f"of {rec.name!r}", path=where)
        if (rec.file_id, rec.size, rec.parts) != (first.file_id, first.size, first.parts):
            raise VolumeLayoutError(f"volume drive {d} holds a part of another write of "
                                    f"{vpath.name!r} than drive 0 (ids {rec.file_id} and "
                                    f"{first.file_id}, sizes {rec.size} and {first.size})",
                                    path=where)
    return first
