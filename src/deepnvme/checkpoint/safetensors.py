"""safetensors files with parallel O_DIRECT I/O, byte-compatible with the ``safetensors`` package.

The layout, dtype table and header validation live in :mod:`deepnvme.formats.safetensors`;
deepnvme pads the JSON header with spaces up to a 4096-byte boundary, so the data starts
O_DIRECT-aligned. This module checks tensors, plans the transfers and runs them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..config import IOConfig, checkpoint_config
from ..formats.safetensors import SafetensorsHeader, build_header, dtype_name, locate, read_header
from ..handles.aio import AioHandle
from ..io import durable
from ..io.file import reserve
from ..io.mapped import map_private
from ..io.volume import Volume, VolumePath
from ..memory.views import storage_bytes
from ._folders import load_folder
from ._fresh import read_fresh
from ._load_path import load_paths
from ._paths import as_path
from ._placed import load_placed_folder
from .inplace import load_into

__all__ = ["save_safetensors", "load_safetensors"]

log = logging.getLogger(__name__)


def _layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
            ) -> tuple[bytes, list[tuple[torch.Tensor, int]]]:
    """Check ``tensors`` as the package does; return the header bytes and (byte view, offset) pairs."""
    seen: dict[tuple[int, int], str] = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"save_safetensors takes a dict of str to tensor, got {name!r}: "
                            f"{type(t).__name__}")
        try:
            dtype_name(t.dtype)
        except TypeError as exc:
            raise TypeError(f"tensor {name!r}: {exc}") from None
        if t.layout != torch.strided:
            raise TypeError(f"tensor {name!r} is {t.layout}; only dense tensors can be saved")
        if not t.is_contiguous():
            raise ValueError(f"tensor {name!r} is not contiguous; call .contiguous() first")
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() and key in seen:
            raise ValueError(f"tensors {seen[key]!r} and {name!r} share memory; safetensors "
                             "stores each tensor once: save a .clone() of one of them")
        seen[key] = name
    head, layout = build_header(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), metadata)
    items = [(storage_bytes(t.untyped_storage())[t.storage_offset() * t.element_size():]
              [:layout.tensors[n].nbytes].cpu(), layout.data_start + layout.tensors[n].begin)
             for n, t in tensors.items()]
    return head, items


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str],
                     metadata: Mapping[str, str] | None = None, *,
                     config: IOConfig | Mapping[str, Any] | None = None) -> None:
    """Write ``tensors`` to a ``.safetensors`` file; blocks until it is durable (atomic replace).

    Readable by ``safetensors.torch.load_file``. Tensors must be contiguous and must not share
    memory (the package's rules); CUDA tensors are copied to the CPU first.
    """
    path = as_path(path, "deepnvme.save_safetensors")
    cfg = checkpoint_config(config)
    head, items = _layout(tensors, metadata)
    header = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    size = len(head) + sum(t.numel() for t, _ in items)
    with durable.atomic_target(path) as tmp:
        reserve(tmp, size)
        with AioHandle(config=cfg) as handle:
            handle.write_many(tmp, [(header, 0), *items], fsync=True).result()


def load_safetensors(path: str | os.PathLike[str] | Volume | VolumePath,
                     device: str | torch.device = "cpu", *,
                     mmap: bool | None = None, populate: bool = True,
                     config: IOConfig | Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file (the package's or ours) into a dict of tensors on ``device``.

    Blocks. The tensors are views of one region per file, read by the path the device is
    fastest with (the ``load_path`` setting, measured per device on first use, see
    :mod:`deepnvme.checkpoint._load_path`): ``mmap=False`` reads with O_DIRECT into new aligned
    memory; ``mmap=True`` gives copy-on-write views of a mapping of the file, as
    ``safetensors.torch.load_file`` does (see :mod:`deepnvme.io.mapped` for what that implies),
    read in before returning by ``intra_op_parallelism`` threads unless ``populate=False``
    (pages read on first use). ``mmap=None`` (the default) takes the device's path. Then the
    tensors move to ``device`` if it is not the CPU. Truncated or inconsistent files raise
    :class:`CheckpointFormatError`. A folder holding ``model.safetensors``, or shards named by
    ``model.safetensors.index.json``, gives one dict of every file's tensors.

    A :class:`~deepnvme.Volume` or a folder on one (``vol / "name"``) is a folder saved there by
    :func:`deepnvme.save_safetensors_sharded`: each shard is read on its drive, the drives at once.
    """
    if isinstance(path, (Volume, VolumePath)):
        return load_placed_folder(path, "safetensors", lambda file: load_safetensors(
            file, device, mmap=mmap, populate=populate, config=config))
    path = as_path(path, "deepnvme.load_safetensors",
                   "a str or os.PathLike file or folder path, a Volume or a volume folder")
    if os.path.isdir(path):
        return load_folder(path, "safetensors", lambda file: load_safetensors(
            file, device, mmap=mmap, populate=populate, config=config))
    cfg = checkpoint_config(config)
    header = read_header(path)
    if not mmap and torch.device(device).type == "cuda":
        return _to_cuda(path, header, torch.device(device), cfg)
    how = ("mapped" if mmap else "direct") if mmap is not None else load_paths(path, cfg).fresh
    if how == "mapped" and not populate:
        return _mapped(path, header, device)
    log.debug("deepnvme.load_safetensors: %s read %s", path, how)
    return _to_device(read_fresh(locate(header, path), how, cfg), device)


def _to_cuda(path: str, header: SafetensorsHeader, device: torch.device,
             cfg: IOConfig) -> dict[str, torch.Tensor]:
    """Read straight into new device tensors through pinned buffers (``load_into``'s fill), so
    reads overlap the copies and no CPU copy of the model is made."""
    out = {name: torch.empty(e.shape, dtype=e.dtype, device=device)
           for name, e in header.tensors.items()}
    load_into(out, path, config=cfg)
    return out


def _mapped(path: str, header: SafetensorsHeader, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Views of a lazily read mapping (``mmap=True, populate=False``)."""
    mapping = map_private(path)
    out: dict[str, torch.Tensor] = {}
    for name, e in header.tensors.items():
        start = header.data_start + e.begin
        raw = storage_bytes(mapping[start:start + e.nbytes])
        out[name] = raw.view(e.dtype).reshape(e.shape) if e.nbytes else torch.empty(e.shape, dtype=e.dtype)
    return _to_device(out, device)


def _to_device(out: dict[str, torch.Tensor], device: str | torch.device) -> dict[str, torch.Tensor]:
    if torch.device(device).type != "cpu":
        return {k: v.to(device) for k, v in out.items()}
    return out
