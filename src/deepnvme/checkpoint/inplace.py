"""``deepnvme.load_into``: fill an existing model's tensors from a checkpoint, in place.

Everything about the files is read and checked first (headers, ``data.pkl``, the shard index),
then names and shapes are matched (:mod:`._fill_plan`), and only then do bytes move: straight
into the destination tensors where dtype and layout allow, else through a few bounce buffers.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping, MutableMapping, Sequence
from concurrent.futures import Future, wait
from typing import Any, NamedTuple

import torch

from ..config import IOConfig, checkpoint_config
from ..errors import UnsupportedBufferError
from ..formats.index import tensor_index
from ..formats.safetensors import StoredTensor
from ..handles.aio import AioHandle, wait_all
from ..memory import pinned
from ..memory.views import aligned_empty, cast_to_byte_tensor
from ._fill_plan import Fill, FillPlan, TargetSpec, chunks, mismatch_error, plan_fill
from ._load_path import load_paths
from ._mapped_fill import fill_mapped
from ._paths import as_path

__all__ = ["LoadResult", "load_into", "BOUNCE_SLOTS", "BOUNCE_CHUNK"]

BOUNCE_SLOTS = 4
"""Bounce buffers in flight at once (reads of the next chunks overlap the copy of one)."""
BOUNCE_CHUNK = 8 << 20
"""Target bytes per bounce read (bytes); a chunk is whole rows of dimension 0, at least one."""


class LoadResult(NamedTuple):
    """Names the target has and the file lacks, and names the file has and the target lacks."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_into(target: torch.nn.Module | MutableMapping[str, torch.Tensor],
              path: str | os.PathLike[str], *, strict: bool = True,
              config: IOConfig | Mapping[str, Any] | None = None) -> LoadResult:
    """Fill ``target``'s tensors in place from the checkpoint at ``path``, like
    ``Module.load_state_dict``, without building a second copy of the model. Blocks until every
    byte is read.

    Args:
        target: a ``torch.nn.Module`` (its ``state_dict()`` tensors, persistent buffers included)
            or a dict of name -> tensor; dense tensors on CPU or CUDA. Tied tensors (the same view
            of the same memory) are filled once, and a tied name the file lacks (as
            ``safetensors.torch.save_model`` writes them) is not missing. Modules' custom
            ``_load_from_state_dict`` hooks are not run: bytes are written, not loaded through hooks.
        path: a ``.safetensors`` file, a ``torch.save`` file of a state dict, or a Hugging Face
            folder: ``model.safetensors``, ``model.safetensors.index.json`` and its shards,
            ``pytorch_model.bin``, or ``pytorch_model.bin.index.json`` and its shards (only the
            files the index names are read). A file's format is told by its bytes, not its name;
            a tensor in two files, or not in the shard the index names, is a malformed checkpoint.
        strict: if true (the default), a name the target has and the file lacks, or the file has
            and the target lacks, is an error; if false, such names are skipped and returned.
            Shape mismatches and dtype pairs ``Tensor.copy_`` cannot convert are errors either way.
        config: I/O settings for the reads (an :class:`IOConfig` or a dict of its settings);
            settings left at the library default take the checkpoint profile
            (:data:`deepnvme.config.CHECKPOINT_DEFAULTS`).

    Returns:
        :class:`LoadResult`: the missing and the unexpected names (both empty when ``strict``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TypeError, UnsupportedBufferError: a target entry that is not a dense tensor with memory,
            or a module whose ``state_dict()`` hands out copies.
        CheckpointFormatError: a malformed file or folder, before anything is matched.
        CheckpointMismatchError: every shape mismatch, unconvertible dtype and (with ``strict``)
            missing and unexpected name at once, before any destination byte changes.
        DeepNVMeIOError: a read failed; the target can then be partly filled.

    Path: CPU targets are filled the way the file's device is fastest with (the ``load_path``
    setting, measured per device on first use, see :mod:`deepnvme.checkpoint._load_path`):
    ``direct`` or ``mapped`` (copied from a private mapping of the file, window by window,
    with dtype conversion; no bounce buffers; at most ``2 x 32 MiB`` or two of the largest
    tensor of page-cache pages mapped at once).

    Memory (``direct``): a CPU contiguous target of the file's dtype is read into directly (no
    copy); a CUDA one through the handle's pinned staging pipeline; any other (dtype
    conversion, non-contiguous) through bounce buffers and ``Tensor.copy_``. Peak extra memory:
    ``BOUNCE_SLOTS x max(BOUNCE_CHUNK, largest dim-0 row, largest strided stored span)`` bytes
    of bounce (only if a tensor needs it) + the handle's staging for CUDA targets
    (``3 x (max(8 MiB, block_size x intra_op_parallelism) + alignment)``) + headers and
    ``data.pkl``.
    """
    path = as_path(path, "deepnvme.load_into")
    tensors = _target_tensors(target)
    sources = tensor_index(path).tensors
    plan = plan_fill({name: _spec(t) for name, t in tensors.items()}, sources)
    error = mismatch_error(plan, strict=strict)
    if error is not None:
        raise error
    _run(plan, tensors, checkpoint_config(config))
    return LoadResult(list(plan.missing), list(plan.unexpected))


def _target_tensors(target: object) -> dict[str, torch.Tensor]:
    if isinstance(target, torch.nn.Module):
        items: Mapping[Any, Any] = target.state_dict()
        _check_aliases(target, items)
    elif isinstance(target, Mapping):
        items = target
    else:
        raise TypeError(f"load_into: target must be a torch.nn.Module or a dict of name -> tensor, "
                        f"got {type(target).__name__}")
    out: dict[str, torch.Tensor] = {}
    for name, t in items.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"load_into: target entry {name!r} is a {type(t).__name__}; only str -> "
                            "tensor entries can be filled")
        if t.layout != torch.strided or t.device.type == "meta":
            raise UnsupportedBufferError(f"load_into: target {name!r} is a {t.layout} tensor on "
                                         f"{t.device}; only dense tensors with memory can be filled")
        out[name] = t.detach()
    return out


def _check_aliases(module: torch.nn.Module, items: Mapping[Any, Any]) -> None:
    """``state_dict()`` must hand out the module's own memory, or filling it would change nothing
    (a state-dict hook that returns copies): refuse such modules rather than load silently nowhere."""
    own = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers()) if t.numel()}
    for name, t in items.items():
        if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in own:
            raise UnsupportedBufferError(
                f"load_into: {type(module).__name__}.state_dict()[{name!r}] is not memory of the "
                "module's parameters or buffers (a state_dict hook copies it), so it cannot be filled "
                "in place: load a dict and call load_state_dict instead")


def _spec(t: torch.Tensor) -> TargetSpec:
    alias = None
    if t.numel():
        alias = (t.device.type, t.device.index, t.untyped_storage().data_ptr(), t.storage_offset(),
                 tuple(t.shape), t.stride(), t.dtype)
    return TargetSpec(t.dtype, tuple(t.shape), t.is_contiguous(), t.device.type, alias)


def _run(plan: FillPlan, tensors: Mapping[str, torch.Tensor], cfg: IOConfig) -> None:
    """CPU targets by the device's path (:mod:`._load_path`): mapped, or with the rest: start
    every direct and staged read, then pump the bounce reads; wait for all."""
    fills = [f for f in plan.fills if f.source.nbytes]
    on_cpu = [f for f in fills if tensors[f.name].device.type == "cpu"]
    if on_cpu and load_paths(on_cpu[0].source.file, cfg).into == "mapped":
        fill_mapped(on_cpu, tensors, threads=cfg.intra_op_parallelism)
        fills = [f for f in fills if tensors[f.name].device.type != "cpu"]
        if not fills:
            return
    direct: dict[str, list[tuple[torch.Tensor, int]]] = {}
    bounce: list[Fill] = []
    futures: list[Future[int]] = []
    with AioHandle(config=cfg) as handle:
        try:
            for fill in fills:
                src, dst = fill.source, tensors[fill.name]
                if src.nbytes == 0:
                    continue
                if fill.route == "direct":
                    direct.setdefault(src.file, []).append((cast_to_byte_tensor(dst), src.offset))
                elif fill.route == "staged":
                    futures.append(handle.submit_read(dst, src.file, offset=src.offset))
                else:
                    bounce.append(fill)
            futures.extend(handle.read_many(file, items) for file, items in direct.items())
            if bounce:
                _bounce(handle, bounce, tensors)
        except BaseException:
            wait(futures)  # no read may target a tensor after this returns; the first error wins
            raise
        wait_all(futures)


def _bounce(handle: AioHandle, fills: Sequence[Fill], tensors: Mapping[str, torch.Tensor]) -> None:
    """Read chunks into ``BOUNCE_SLOTS`` buffers in turn; each is copied into its target (with
    dtype conversion) once read, and the buffer reused."""
    work = [(fill, chunk) for fill in fills for chunk in chunks(fill.source, BOUNCE_CHUNK)]
    size = max(chunk.nbytes for _, chunk in work)
    on_cpu = all(tensors[f.name].device.type == "cpu" for f in fills)
    free = deque(aligned_empty(size) if on_cpu else pinned.new_cpu_locked_tensor(size)
                 for _ in range(min(BOUNCE_SLOTS, len(work))))
    flight: deque[tuple[Future[int], torch.Tensor, int, StoredTensor, torch.Tensor,
                        tuple[int, int] | None]] = deque()
    try:
        for fill, chunk in work:
            if not free:
                free.append(_land(*flight.popleft()))
            buf = free.popleft()
            fut = handle.submit_read(buf[:chunk.nbytes], fill.source.file, offset=chunk.offset)
            flight.append((fut, buf, chunk.nbytes, fill.source, tensors[fill.name], chunk.rows))
        while flight:
            _land(*flight.popleft())
    except BaseException:
        wait([f for f, *_ in flight])  # the buffers outlive every read into them
        raise


def _land(fut: Future[int], buf: torch.Tensor, nbytes: int, src: StoredTensor, dst: torch.Tensor,
          rows: tuple[int, int] | None) -> torch.Tensor:
    """Wait for one chunk and copy it into its target rows; return the buffer, free again."""
    fut.result()
    data = buf[:nbytes].view(src.dtype)
    if rows is None:
        view = data.as_strided(src.shape, src.stride) if src.stride is not None else data.view(src.shape)
        part = dst
    else:
        view = data.view((rows[1] - rows[0], *src.shape[1:]))
        part = dst[rows[0]:rows[1]]
    with torch.no_grad():
        part.copy_(view)
    return buf
