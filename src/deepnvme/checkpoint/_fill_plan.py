"""Pure planning for ``load_into``: match file tensors to target tensors, route each transfer.

Targets that are the same view of the same memory (tied parameters) form one group, filled
once, and a group member the file lacks is not missing when another member is present.
Routes: ``direct`` (CPU, contiguous, same dtype: the engine reads into the tensor's memory),
``staged`` (a CUDA tensor, contiguous, same dtype: the handle's staging pipeline) and
``bounce`` (anything else: chunks through a few CPU buffers, then ``Tensor.copy_``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping
from typing import Literal

import torch

from ..errors import CheckpointMismatchError
from ._stored import StoredTensor

__all__ = ["TargetSpec", "Fill", "FillPlan", "Chunk", "plan_fill", "route", "chunks",
           "mismatch_error", "Route"]

Route = Literal["direct", "staged", "bounce"]


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """What the planner needs of a destination tensor; ``alias`` is equal for tensors that are
    the same view of the same memory (None: never shared)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    contiguous: bool
    device_type: str
    alias: Hashable | None = None


@dataclasses.dataclass(frozen=True)
class Fill:
    """Fill target ``name`` from ``source`` by ``route``; ``tied`` lists the other target names
    sharing its memory (filled by the same transfer)."""

    name: str
    source: StoredTensor
    route: Route
    tied: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class FillPlan:
    """The transfers, and the names that do not match (as ``Module.load_state_dict`` reports)."""

    fills: tuple[Fill, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Read ``nbytes`` at file ``offset`` into rows ``[row_start, row_end)`` of dimension 0
    (``rows`` None: the whole tensor in one piece)."""

    offset: int
    nbytes: int
    rows: tuple[int, int] | None


def route(spec: TargetSpec, src: StoredTensor) -> Route:
    """How bytes of ``src`` reach a target described by ``spec``."""
    if spec.dtype != src.dtype or not spec.contiguous or src.stride is not None:
        return "bounce"
    if spec.device_type == "cpu":
        return "direct"
    return "staged" if spec.device_type == "cuda" else "bounce"


def plan_fill(targets: Mapping[str, TargetSpec], sources: Mapping[str, StoredTensor]) -> FillPlan:
    """Match by name (targets in their order); shapes must be equal, dtypes may differ."""
    groups: dict[Hashable, list[str]] = {}
    for name, spec in targets.items():
        groups.setdefault(("alias", spec.alias) if spec.alias is not None else ("name", name), []).append(name)
    fills: list[Fill] = []
    missing: list[str] = []
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for names in groups.values():
        present = [n for n in names if n in sources]
        if not present:
            missing.extend(names)
            continue
        good = []
        for n in present:
            if sources[n].shape != targets[n].shape:
                mismatched.append((n, sources[n].shape, targets[n].shape))
            else:
                good.append(n)
        if good:
            first = good[0]
            fills.append(Fill(first, sources[first], route(targets[first], sources[first]),
                              tuple(n for n in names if n != first)))
    unexpected = tuple(n for n in sources if n not in targets)
    order = {n: i for i, n in enumerate(targets)}
    return FillPlan(tuple(fills), tuple(sorted(missing, key=order.__getitem__)), unexpected,
                    tuple(mismatched))


def mismatch_error(plan: FillPlan, *, strict: bool) -> CheckpointMismatchError | None:
    """The one error for ``plan`` (None if it may run): shape mismatches always, missing and
    unexpected names with ``strict`` (``Module.load_state_dict``'s rules)."""
    missing = plan.missing if strict else ()
    unexpected = plan.unexpected if strict else ()
    if not (missing or unexpected or plan.mismatched):
        return None
    parts = []
    if missing:
        parts.append(f"missing keys ({len(missing)}): {', '.join(map(repr, missing))}")
    if unexpected:
        parts.append(f"unexpected keys ({len(unexpected)}): {', '.join(map(repr, unexpected))}")
    for name, file_shape, target_shape in plan.mismatched:
        parts.append(f"size mismatch for {name!r}: the checkpoint has shape {list(file_shape)}, "
                     f"the target {list(target_shape)}")
    hint = "; pass strict=False to load the matching keys only" if missing or unexpected else ""
    return CheckpointMismatchError("the checkpoint does not fit the target (nothing was loaded): "
                                   + "; ".join(parts) + hint, missing_keys=plan.missing,
                                   unexpected_keys=plan.unexpected, mismatched=plan.mismatched)


def chunks(src: StoredTensor, chunk_bytes: int) -> list[Chunk]:
    """Cut ``src`` into reads of whole rows of dimension 0, each at most ``chunk_bytes`` or one
    row; a strided or 0-d source is one piece of its full byte span."""
    if src.stride is not None or not src.shape or src.nbytes == 0:
        return [Chunk(src.offset, src.nbytes, None)]
    row_bytes = math.prod(src.shape[1:]) * src.dtype.itemsize
    per = max(1, chunk_bytes // max(row_bytes, 1))
    rows = src.shape[0]
    return [Chunk(src.offset + r * row_bytes, (min(r + per, rows) - r) * row_bytes, (r, min(r + per, rows)))
            for r in range(0, rows, per)]
