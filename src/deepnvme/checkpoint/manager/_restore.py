"""Reading a manager checkpoint for ``restore``: straight into the state's existing tensors.

The file's object is first rebuilt with ``meta`` tensors (no data read) and checked against the
manifest, so the caller can match names and shapes before any byte moves. Then each storage
record is read either into the destination tensor that already holds that entry (a module's
``state_dict()`` tensor, an optimizer's existing state tensor, a plain tensor in ``state``) or,
where none fits, into new memory. Stored checksums are computed on the bytes as read (the
destination's). The rebuilt object holds the filled destinations, so ``load_state_dict`` /
``copy_`` afterwards copy a tensor onto itself, which PyTorch skips. A partial restore
(``strict=False``) reads only the records of the entries the state and the checkpoint share.

A record is filled in place when exactly one saved tensor views it, whole and contiguous, and
the destination is a CPU contiguous tensor of the same dtype and shape whose memory no other
record fills. Memory: the records that are not filled in place (RNG states, an optimizer's
state before its first step, ...), each rounded up for O_DIRECT alignment.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...config import IOConfig
from ...errors import CheckpointMismatchError
from ...handles.aio import AioHandle
from ...memory.views import aligned_empty, cast_to_byte_tensor
from ._checksums import named_storages
from ._rank_state import fill, refuse_other_world
from ._rng import restore_rng
from ._steps import RANK_STATE_KEY
from ._verify import check_sums, checked_skeleton, open_checked

__all__ = ["Skeleton", "open_skeleton", "read_into", "check_fit", "restore_state", "restore_file"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Skeleton:
    """A checked checkpoint's object with ``meta`` tensors, and what is needed to read it."""

    obj: Any
    file: str
    what: str
    manifest: dict[str, Any]
    keys: dict[int, str]  # meta storage _cdata -> record key
    offsets: dict[str, int]  # record key -> file offset of its bytes
    sizes: dict[str, int]  # record key -> bytes


def open_skeleton(path: str, step: int, *, drives: Sequence[str] | None = None) -> Skeleton:
    """The checkpoint directory ``path``'s object without data, checked against its manifest
    (file size, tensor names and sizes): :class:`CheckpointCorruptError` otherwise. ``drives``:
    a manager's drive folders on a volume (:func:`._verify.state_file`)."""
    manifest, what, file = open_checked(path, step, drives=drives)
    obj, keys, spans = checked_skeleton(file, manifest, what)
    return Skeleton(obj, file, what, manifest, keys, {k: s.offset for k, s in spans.items()},
                    {k: s.size for k, s in spans.items()})


def _pairs(saved: Any, dest: Any, out: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Every meta tensor of ``saved`` with the tensor at the same place in ``dest`` (or None)."""
    if isinstance(saved, torch.Tensor):
        out.append((saved, dest.detach() if isinstance(dest, torch.Tensor) else None))
    elif isinstance(saved, dict):
        for k, v in saved.items():
            _pairs(v, dest.get(k) if isinstance(dest, dict) else None, out)
    elif isinstance(saved, (list, tuple)):
        same = isinstance(dest, (list, tuple)) and len(dest) == len(saved)
        for i, v in enumerate(saved):
            _pairs(v, dest[i] if same else None, out)


def _fits(meta: torch.Tensor, dst: torch.Tensor | None, size: int) -> bool:
    return (dst is not None and dst.device.type == "cpu" and dst.layout == torch.strided
            and dst.is_contiguous() and dst.dtype == meta.dtype and dst.shape == meta.shape
            and meta.is_contiguous() and meta.storage_offset() == 0
            and meta.numel() * meta.element_size() == size > 0)


def read_into(sk: Skeleton, dests: Mapping[str, Any], config: IOConfig,
              names: Collection[str] | None = None) -> dict[str, Any]:
    """Read ``sk``'s data, in place into the matching tensors of ``dests`` (name -> tensor or
    state dict, parallel to the saved object) where they fit; verify stored checksums; return
    the object (a dict) with real tensors. ``names``: only these entries (None: all). A checksum
    mismatch raises after the bytes are in place."""
    chosen = [n for n in sk.obj if names is None or n in names]
    pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for name in chosen:
        _pairs(sk.obj[name], dests.get(name), pairs)
    users: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    for meta, dst in pairs:
        users.setdefault(sk.keys[meta.untyped_storage()._cdata], []).append((meta, dst))
    data: dict[str, torch.Tensor] = {}  # record key -> uint8 tensor its bytes are read into
    real: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its real tensor
    taken: set[int] = set()
    fresh: list[str] = []
    for key, group in users.items():
        meta, dst = group[0]
        size = sk.sizes[key]
        if (len(group) == 1 and dst is not None and _fits(meta, dst, size)
                and dst.untyped_storage().data_ptr() not in taken):
            taken.add(dst.untyped_storage().data_ptr())
            data[key], real[id(meta)] = cast_to_byte_tensor(dst), _like(meta, dst)
            continue
        buf = data[key] = aligned_empty(size, sk.offsets[key]) if size else torch.empty(0, dtype=torch.uint8)
        fresh.append(key)
        for m, _ in group:
            real[id(m)] = _like(m, torch.empty(0, dtype=m.dtype).set_(
                buf.untyped_storage(), m.storage_offset(), m.shape, m.stride()))
    if fresh:
        log.debug("CheckpointManager.restore %s: %d of %d records read into new memory (no existing "
                  "tensor of the same dtype and shape to fill): %s", sk.what, len(fresh), len(users),
                  fresh[:20])
    items = [(buf, sk.offsets[key]) for key, buf in data.items() if buf.numel()]
    if items:
        with AioHandle(config=config) as handle:
            handle.read_many(sk.file, items).result()
    by_storage = {st._cdata: n for n, st in named_storages(sk.obj)}   # the manifest's names
    check_sums({by_storage[cdata]: data[key] for cdata, key in sk.keys.items()
                if cdata in by_storage and key in data}, sk.manifest, sk.what, partial=names is not None)
    return {n: _swap(sk.obj[n], lambda t: real[id(t)]) for n in chosen}


def _like(meta: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` as the unpickled ``meta`` was: a Parameter, or requiring grad, when it was."""
    if isinstance(meta, torch.nn.Parameter):
        return torch.nn.Parameter(t, requires_grad=meta.requires_grad)
    return t.requires_grad_(True) if meta.requires_grad else t


def _swap(value: Any, tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by ``tensor(it)``: dicts and lists in place (their
    types and attributes such as a state dict's ``_metadata`` kept), tuples rebuilt."""
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, dict):
        for k, v in value.items():
            value[k] = _swap(v, tensor)
    elif isinstance(value, list):
        value[:] = [_swap(v, tensor) for v in value]
    elif isinstance(value, tuple):
        items = [_swap(v, tensor) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def check_fit(what: str, saved: Mapping[str, Any], state: Mapping[str, Any], dests: Mapping[str, Any], *,
              rng_key: str, strict: bool = True) -> list[str]:
    """Names of ``state`` and the checkpoint, shapes of its tensors and of its modules' state
    dicts (``saved`` may hold ``meta`` tensors): one :class:`CheckpointMismatchError`. Not
    ``strict``: names (and module state dict keys) on one side only are left out, shapes must
    still match, and at least one name must be shared. Returns the names of ``state`` to restore."""
    names = [n for n in saved if n not in (rng_key, RANK_STATE_KEY)]
    missing = [n for n in state if n not in saved]
    extra = [n for n in names if n not in state]
    shapes = [(n, tuple(saved[n].shape), tuple(v.shape)) for n, v in state.items()
              if isinstance(v, torch.Tensor) and n in saved
              and (not isinstance(saved[n], torch.Tensor) or saved[n].shape != v.shape)]
    for n, v in state.items():
        if isinstance(v, torch.nn.Module) and isinstance(saved.get(n), dict):
            have, want = saved[n], dests[n]
            missing += [f"{n}/{k}" for k in want if k not in have]
            extra += [f"{n}/{k}" for k in have if k not in want]
            shapes += [(f"{n}/{k}", tuple(t.shape), tuple(want[k].shape)) for k, t in have.items()
                       if isinstance(t, torch.Tensor) and isinstance(want.get(k), torch.Tensor)
                       and t.shape != want[k].shape]
    shared = [n for n in state if n in saved]
    if not strict and shapes:
        missing, extra = [], []   # left out by a partial restore; the shapes are the error
    elif not strict and not shared:
        raise CheckpointMismatchError(
            f"{what} shares no entry with the state: the checkpoint holds {names}, the state "
            f"{list(state)}", missing_keys=missing, unexpected_keys=extra, mismatched=shapes)
    elif not strict:
        if missing or extra:
            log.info("CheckpointManager.restore(strict=False) %s: left as they are %s; not read "
                     "%s", what, missing, extra)
        return shared
    if missing or extra or shapes:
        hint = "" if shapes else "; restore(state, strict=False) restores the entries both have"
        raise CheckpointMismatchError(
            f"{what} does not fit the state: not in the checkpoint "
            f"{missing}, not in the state {extra}, shapes {shapes}{hint}",
            missing_keys=missing, unexpected_keys=extra, mismatched=shapes)
    return shared


def restore_state(path: str, step: int, state: MutableMapping[str, Any], config: IOConfig, *,
                  what: str, rng_key: str, strict: bool = True,
                  check: Callable[[Mapping[str, Any]], None] | None = None,
                  drives: Sequence[str] | None = None) -> dict[str, Any]:
    """Load the checkpoint directory ``path`` into ``state`` in place (see
    ``CheckpointManager.restore``); return the entries read, ``rng_key``'s and the per-rank
    state's among them if saved. ``check(saved)`` sees the saved object (``meta`` tensors) first.
    Checks names and shapes before anything changes (:func:`check_fit`)."""
    sk = open_skeleton(path, step, drives=drives)
    if not isinstance(sk.obj, dict):
        raise CheckpointMismatchError(f"{what} holds a {type(sk.obj).__name__}")
    dests = {n: v.state_dict() if callable(getattr(v, "state_dict", None)) else v for n, v in state.items()}
    names = check_fit(what, sk.obj, state, dests, rng_key=rng_key, strict=strict)
    if check is not None:
        check(sk.obj)
    saved = read_into(sk, dests, config, names=None if strict else {*names, rng_key, RANK_STATE_KEY})
    for name in names:
        value = state[name]
        if isinstance(value, torch.Tensor):
            with torch.no_grad():
                value.copy_(saved[name])
        elif isinstance(value, torch.nn.Module):
            value.load_state_dict(saved[name], strict=strict)
        elif callable(getattr(value, "load_state_dict", None)):
            value.load_state_dict(saved[name])
        else:
            state[name] = saved[name]
    return saved


def restore_file(path: str, step: int, state: MutableMapping[str, Any], config: IOConfig, *,
                 rng_key: str, rng: bool, strict: bool, rank_state: Any, world: int,
                 drives: Sequence[str] | None = None) -> None:
    """Restore the single-process step at ``path`` into ``state`` (:func:`restore_state`) in each
    of ``world`` processes: the RNG states (``rng_key``'s entry) when ``rng`` and saved, and the saved
    per-rank state into ``rank_state`` (see :mod:`._rank_state`; checked before any data is read)."""
    what = f"step {step} in {os.path.dirname(path)!r}"
    mine: list[bool] = []

    def check(obj: Mapping[str, Any]) -> None:
        keys = sorted(obj[RANK_STATE_KEY]) if isinstance(obj.get(RANK_STATE_KEY), dict) else None
        mine.append(refuse_other_world(keys, saved_world=1, world=world, rank_state=rank_state,
                                       what=f"checkpoint {what}"))

    saved = restore_state(path, step, state, config, what=what, rng_key=rng_key, strict=strict,
                          check=check, drives=drives)
    if mine and mine[0]:
        fill(rank_state, saved.get(RANK_STATE_KEY))
    if rng and rng_key in saved:
        restore_rng(saved[rng_key])
