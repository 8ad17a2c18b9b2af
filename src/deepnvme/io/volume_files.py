"""The layout records of striped files on disk: read and checked before a request, written
durably (:func:`deepnvme.io.durable.write_json`) before a write grows the file.

A record is read again only when its file changed since it was last checked
(inode, mtime, size), so a request on an unchanged file costs two ``stat`` calls per drive
(its record and its part).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import threading
import uuid

from ..errors import DeepNVMeIOError, VolumeLayoutError
from .durable import fsync_dir, write_json
from .file import reserve
from .volume import VolumePath, VolumeRecord, check_records

__all__ = ["Layouts", "striped_size", "temp_path", "rename", "remove"]

_Sig = tuple[int, int, int]


class Layouts:
    """Checked layout records of striped files, cached per file. Thread-safe (one lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[VolumePath, tuple[tuple[_Sig, ...], VolumeRecord]] = {}

    def current(self, vpath: VolumePath) -> VolumeRecord:
        """The layout of an existing striped file, checked against its volume on every drive.
        Raises :class:`VolumeLayoutError` naming the drive and file of the first problem."""
        with self._lock:
            return self._current(vpath)

    def ensure(self, vpath: VolumePath, end: int) -> VolumeRecord:
        """Before a write ending at logical byte ``end``: create the file (directories, empty
        parts, records) if no drive has it, or grow its records to ``end`` bytes. A file found
        on some drives but not others, or not matching the volume, raises."""
        with self._lock:
            present = [os.path.exists(vpath.record(d)) for d in range(vpath.drives)]
            if not any(present):
                return self._create(vpath, end)
            rec = self._current(vpath, parts_complete=False)
            if rec.size >= end:
                return rec
            return self._publish(vpath, end, rec.file_id)

    def forget(self, vpath: VolumePath) -> None:
        with self._lock:
            self._cache.pop(vpath, None)

    def _current(self, vpath: VolumePath, *, parts_complete: bool = True) -> VolumeRecord:
        """The checked record; with ``parts_complete`` (reads), every part must hold the bytes
        its record names (a write may still be filling them: ``ensure`` skips that check)."""
        n = vpath.drives
        sigs = tuple(_signature(_stat(vpath, d, vpath.record(d), "record")) for d in range(n))
        cached = self._cache.get(vpath)
        if cached is not None and cached[0] == sigs:
            rec = cached[1]
        else:
            rec = check_records(vpath, [_read(vpath, d) for d in range(n)])
            self._cache[vpath] = (sigs, rec)
        for d in range(n):
            size = _stat(vpath, d, vpath.part(d), "part").st_size
            if parts_complete and size < rec.parts[d]:
                raise VolumeLayoutError(
                    f"volume drive {d}: the part of {vpath.name!r} has {size} bytes, its "
                    f"record says {rec.parts[d]} (truncated, replaced, or its write did not "
                    "finish)", path=vpath.part(d))
        return rec

    def _create(self, vpath: VolumePath, end: int) -> VolumeRecord:
        for d in range(vpath.drives):
            part = vpath.part(d)
            try:
                os.makedirs(os.path.dirname(part), exist_ok=True)
                os.close(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
            except OSError as exc:
                raise DeepNVMeIOError.from_oserror(exc, op=f"create volume drive {d} part",
                                                   path=part, offset=None, size=None) from None
        return self._publish(vpath, end, uuid.uuid4().hex)

    def _publish(self, vpath: VolumePath, size: int, file_id: str) -> VolumeRecord:
        recs = [VolumeRecord.for_size(vpath, size, index=d, file_id=file_id)
                for d in range(vpath.drives)]
        for d, rec in enumerate(recs):
            # blocks allocated up front, as deepnvme.save does: O_DIRECT writes then fill
            # reserved extents, and a full drive fails here, before the record grows
            reserve(vpath.part(d), rec.parts[d])
        for d, rec in enumerate(recs):
            write_json(vpath.record(d), rec.to_json())
        self._cache.pop(vpath, None)
        return recs[0]


def _signature(st: os.stat_result) -> _Sig:
    """A record changes only by an atomic replace: a new inode, mtime or size."""
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _stat(vpath: VolumePath, drive: int, path: str, what: str) -> os.stat_result:
    try:
        return os.stat(path)
    except FileNotFoundError:
        directory = vpath.volume.paths[drive]
        why = ("the drive directory does not exist (not mounted?)" if not os.path.isdir(directory)
               else f"its {what} file is missing (never written there, or removed)")
        raise VolumeLayoutError(f"volume drive {drive} ({directory}) has no {what} of "
                                f"{vpath.name!r}: {why}", path=path, errno=errno.ENOENT) from None
    except OSError as exc:
        raise DeepNVMeIOError.from_oserror(exc, op=f"stat volume drive {drive} {what}",
                                           path=path, offset=None, size=None) from None


def _read(vpath: VolumePath, drive: int) -> VolumeRecord:
    path = vpath.record(drive)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise VolumeLayoutError(f"volume drive {drive}: unreadable layout record ({exc})",
                                path=path) from None
    except OSError as exc:
        raise DeepNVMeIOError.from_oserror(exc, op=f"read volume drive {drive} record",
                                           path=path, offset=None, size=None) from None
    return VolumeRecord.from_json(data, where=path)


def striped_size(vpath: VolumePath) -> int:
    """The logical size of the striped file ``vpath``, its layout checked on every drive."""
    return Layouts().current(vpath).size


def temp_path(vpath: VolumePath) -> VolumePath:
    """A fresh temporary name beside ``vpath`` on its volume (this process's pid and a random
    tag), to write a striped file under before :func:`rename` puts it in place."""
    return VolumePath(vpath.volume, f"{vpath.name}.deepnvme-tmp-{os.getpid()}-{secrets.token_hex(4)}")


def rename(src: VolumePath, dst: VolumePath) -> None:
    """Replace ``dst`` with the complete striped file ``src`` (same volume), drive by drive.

    Not atomic across drives; the order keeps every crash point detectable: ``dst``'s records
    go first (a reader then finds no file), then the parts move, then the new records are
    written durably and ``src``'s removed. Blocks.
    """
    if src.volume != dst.volume:
        raise ValueError(f"rename: {src} and {dst} are on different volumes")
    rec = Layouts().current(src)
    for d in range(dst.drives):
        _unlink(dst.record(d))
    for d in range(dst.drives):
        os.makedirs(os.path.dirname(dst.part(d)), exist_ok=True)
        os.replace(src.part(d), dst.part(d))
        fsync_dir(os.path.dirname(dst.part(d)))
    for d in range(dst.drives):
        new = VolumeRecord.for_size(dst, rec.size, index=d, file_id=rec.file_id)
        write_json(dst.record(d), new.to_json())
    for d in range(src.drives):
        _unlink(src.record(d))


def remove(vpath: VolumePath) -> None:
    """Remove the records and parts of ``vpath`` that exist (records first). Blocks."""
    for d in range(vpath.drives):
        _unlink(vpath.record(d))
    for d in range(vpath.drives):
        _unlink(vpath.part(d))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise DeepNVMeIOError.from_oserror(exc, op="remove", path=path, offset=None,
                                           size=None) from None
    fsync_dir(os.path.dirname(path))
