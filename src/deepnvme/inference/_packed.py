"""Writing blocks into one file in the packed, aligned layout, durably, with a manifest.

File ``weights.bin``: block after block, each starting at a multiple of 4096 bytes, tensors
inside at 64-byte offsets (see :func:`plan_packed_block`), so one O_DIRECT read fills a block's
staging buffer. ``manifest.json`` records the layout, the storage setting (quantisation, group
size and compute dtype; None for weights stored as they are) and a fingerprint of the source, so
an aligned copy prepared once is reused while its source and the setting are unchanged.

On a :class:`~deepnvme.Volume` the weights are one striped file (``vol / "weights.bin"``, its
parts and layout records on every drive, so each block is read from all drives at once) and the
manifest lies in the first drive's directory; a volume opened with other drives or another
stripe unit finds no usable copy and writes a new one (logged).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..errors import DeepNVMeError
from ..handles.aio import AioHandle
from ..io.durable import commit, fsync_dir, remove_quietly, temp_name, write_json
from ..io.volume import Volume, VolumePath
from ..io.volume_files import remove, rename, striped_size, temp_path
from ..memory.pinned import free_cpu_locked_tensor, new_cpu_locked_tensor
from ..memory.views import cast_to_byte_tensor
from ._layout import BlockPlan, Span, plan_packed_block

__all__ = ["WEIGHTS_FILE", "MANIFEST_FILE", "PackedTensor", "write_packed", "load_manifest", "source_stats"]

WEIGHTS_FILE = "weights.bin"
MANIFEST_FILE = "manifest.json"
_VERSION = 1

log = logging.getLogger(__name__)

# (key, nbytes, producer of the contiguous CPU tensor whose bytes are written)
PackedTensor = tuple[str, int, Callable[[], torch.Tensor]]


def source_stats(files: Iterable[str]) -> list[list[Any]]:
    """``[basename, size, mtime_ns]`` of each source file, sorted: the part of a fingerprint
    that says whether the files an aligned copy was made from have changed."""
    stats = [(f, os.stat(f)) for f in sorted(set(files))]
    return [[os.path.basename(f), st.st_size, st.st_mtime_ns] for f, st in stats]


def _where(directory: str | Volume) -> tuple[str, str | VolumePath]:
    """The folder holding the manifest, and the weights file (striped on a volume)."""
    if isinstance(directory, Volume):
        return directory.paths[0], directory / WEIGHTS_FILE
    return directory, os.path.join(directory, WEIGHTS_FILE)


def _temporary(path: str | VolumePath) -> str | VolumePath:
    return temp_path(path) if isinstance(path, VolumePath) else temp_name(path)


def _publish(tmp: str | VolumePath, path: str | VolumePath) -> None:
    """Put the written ``tmp`` in place of ``path`` (a striped file's blocks were each written
    with fsync on the parts they touched; a plain file is fsynced here)."""
    if isinstance(tmp, VolumePath):
        assert isinstance(path, VolumePath)  # _temporary keeps the kind of its path
        rename(tmp, path)
    else:
        assert isinstance(path, str)
        commit(tmp, path)


def _discard(tmp: str | VolumePath) -> None:
    if isinstance(tmp, VolumePath):
        remove(tmp)
    else:
        remove_quietly(tmp)


def write_packed(directory: str | Volume, blocks: Sequence[Sequence[PackedTensor]], *, handle: AioHandle,
                 fingerprint: Any = None, setting: Mapping[str, Any] | None = None) -> list[BlockPlan]:
    """Write ``blocks`` to ``directory/weights.bin`` (temp file, fsync, rename, fsync dir; on a
    volume a striped file) and the manifest recording ``setting``; returns each block's read
    plan. Blocking. Peak extra memory: one block."""
    folder, path = _where(directory)
    os.makedirs(folder, exist_ok=True)
    # drop the old manifest first: a crash after the weights are replaced must not leave new
    # weights described by an old manifest (no manifest means "rewrite")
    manifest = os.path.join(folder, MANIFEST_FILE)
    if os.path.exists(manifest):
        os.unlink(manifest)
        fsync_dir(folder)
    layouts = [plan_packed_block([(k, n) for k, n, _ in blk]) for blk in blocks]
    staging = new_cpu_locked_tensor(max(size for _, size in layouts), torch.uint8)
    tmp = _temporary(path)
    striped = isinstance(tmp, VolumePath)
    plans: list[BlockPlan] = []
    try:
        file_offset = 0
        for blk, (offsets, size) in zip(blocks, layouts):
            staging[:size].zero_()
            for key, nbytes, produce in blk:
                data = cast_to_byte_tensor(produce().contiguous())
                if data.numel() != nbytes:
                    raise ValueError(f"tensor {key!r} has {data.numel()} bytes, expected {nbytes}")
                staging[offsets[key]: offsets[key] + nbytes].copy_(data)
            handle.submit_write(staging[:size], tmp, offset=file_offset, fsync=True if striped else None).result()
            plans.append(BlockPlan((Span(path, file_offset, size, 0),), dict(offsets), size))
            file_offset += size
        if striped and not file_offset:  # no blocks: the empty striped file still appears
            handle.submit_write(staging[:0], tmp, fsync=True).result()
        _publish(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    finally:
        free_cpu_locked_tensor(staging)
    write_json(manifest, {
        "version": _VERSION, "fingerprint": fingerprint, "setting": None if setting is None else dict(setting),
        "blocks": [{"file_offset": p.spans[0].file_offset, "nbytes": p.buffer_bytes,
                    "tensors": p.tensor_offsets} for p in plans]})
    return plans


def load_manifest(directory: str | Volume, fingerprint: Any, setting: Mapping[str, Any] | None = None
                  ) -> list[BlockPlan] | None:
    """The block plans of an aligned copy in ``directory`` if it exists and was prepared from
    a source with this ``fingerprint`` and stored with this ``setting`` (a copy written before
    settings were recorded counts as unquantised); None if it must be (re)written."""
    folder, path = _where(directory)
    try:
        with open(os.path.join(folder, MANIFEST_FILE), encoding="utf-8") as f:
            manifest = json.load(f)
        size = striped_size(path) if isinstance(path, VolumePath) else os.path.getsize(path)
    except DeepNVMeError as exc:  # a volume's layout that does not match: write a new copy
        log.info("deepnvme: the aligned copy on %s cannot be used (%s): rewriting it", directory, exc)
        return None
    except (OSError, ValueError):
        return None
    recorded = manifest.get("setting")
    if recorded != (None if setting is None else dict(setting)):
        log.info("deepnvme: %s was prepared with setting %s, not %s: rewriting it", directory, recorded,
                 None if setting is None else dict(setting))
        return None
    if manifest.get("version") != _VERSION or manifest.get("fingerprint") != fingerprint:
        return None
    plans = [BlockPlan((Span(path, b["file_offset"], b["nbytes"], 0),), dict(b["tensors"]), b["nbytes"])
             for b in manifest["blocks"]]
    if any(p.spans[0].file_offset + p.buffer_bytes > size for p in plans):
        return None
    return plans
