"""Pure planning for ``load_into``: match file tensors to target tensors, route each transfer.

Targets that are the same view of the same memory (tied parameters) form one group, filled
once, and a group member the file lacks is not missing when another member is present.
Routes: ``direct`` (CPU, contiguous, same dtype: the engine reads into the tensor's memory),
``staged`` (a CUDA tensor through the handle's staging pipeline, where :data:`CUDA_ROUTE` says
so) and ``bounce`` (anything else: chunks through a few CPU buffers, pinned for device targets,
then ``Tensor.copy_``). A dtype
pair ``Tensor.copy_`` cannot convert (``float4_e2m1fn_x2`` to or from any other) is refused
while planning, with the shape mismatches, rather than failing halfway through the copies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Hashable, Mapping
from typing import Literal

import torch

from ..errors import CheckpointMismatchError
from ..formats.safetensors import StoredTensor

__all__ = ["TargetSpec", "Fill", "FillPlan", "Chunk", "plan_fill", "route", "chunks",
           "mismatch_error", "convertible", "Route"]

Route = Literal["direct", "staged", "bounce"]

#: how a contiguous CUDA target of the file's dtype is filled: "bounce" (chunks through a few
#: pinned buffers, so reads of the next chunks, of any tensor, overlap each copy to the device)
#: or "staged" (one request per tensor through the handle's staging pipeline, which drains at
#: the end of each request). Chosen by measurement (``benchmarks/gpu/bench_load_cuda.py``).
CUDA_ROUTE: Route = "bounce"


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
    """The transfers, and the names that do not match (as ``Module.load_state_dict`` reports);
    ``unconvertible``: (name, file dtype, target dtype) that ``Tensor.copy_`` cannot convert."""

    fills: tuple[Fill, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    unconvertible: tuple[tuple[str, torch.dtype, torch.dtype], ...] = ()


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Read ``nbytes`` at file ``offset`` into rows ``[row_start, row_end)`` of dimension 0
    (``rows`` None: the whole tensor in one piece)."""

    offset: int
    nbytes: int
    rows: tuple[int, int] | None


@functools.cache  # at most one entry per pair of torch dtypes
def convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether ``Tensor.copy_`` converts ``src`` to ``dst``: probed once per pair with one
    element on the CPU (torch decides, not a hand-kept table; conversion warnings silenced)."""
    if src == dst:
        return True
    one = torch.zeros(src.itemsize, dtype=torch.uint8).view(src)
    out = torch.zeros(dst.itemsize, dtype=torch.uint8).view(dst)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # e.g. complex to real discards the imaginary part
            out.copy_(one)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def route(spec: TargetSpec, src: StoredTensor) -> Route:
    """How bytes of ``src`` reach a target described by ``spec``."""
    if spec.dtype != src.dtype or not spec.contiguous or src.stride is not None:
        return "bounce"
    if spec.device_type == "cpu":
        return "direct"
    return CUDA_ROUTE if spec.device_type == "cuda" else "bounce"


def plan_fill(targets: Mapping[str, TargetSpec], sources: Mapping[str, StoredTensor]) -> FillPlan:
    """Match by name (targets in their order); shapes must be equal, dtypes may differ."""
    groups: dict[Hashable, list[str]] = {}
    for name, spec in targets.items():
        groups.setdefault(("alias", spec.alias) if spec.alias is not None else ("name", name), []).append(name)
    fills: list[Fill] = []
    missing: list[str] = []
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    unconvertible: list[tuple[str, torch.dtype, torch.dtype]] = []
    for names in groups.values():
        present = [n for n in names if n in sources]
        if not present:
            missing.extend(names)
            continue
        good = []
        for n in present:
            if sources[n].shape != targets[n].shape:
                mismatched.append((n, sources[n].shape, targets[n].shape))
            elif not convertible(sources[n].dtype, targets[n].dtype):
                unconvertible.append((n, sources[n].dtype, targets[n].dtype))
            else:
                good.append(n)
        if good:
            first = good[0]
            fills.append(Fill(first, sources[first], route(targets[first], sources[first]),
                              tuple(n for n in names if n != first)))
    unexpected = tuple(n for n in sources if n not in targets)
    order = {n: i for i, n in enumerate(targets)}
    return FillPlan(tuple(fills), tuple(sorted(missing, key=order.__getitem__)), unexpected,
                    tuple(mismatched), tuple(unconvertible))


def mismatch_error(plan: FillPlan, *, strict: bool) -> CheckpointMismatchError | None:
    """The one error for ``plan`` (None if it may run): shape mismatches and dtypes ``copy_``
    cannot convert always, missing and unexpected names with ``strict``
    (``Module.load_state_dict``'s rules)."""
    missing = plan.missing if strict else ()
    unexpected = plan.unexpected if strict else ()
    if not (missing or unexpected or plan.mismatched or plan.unconvertible):
        return None
    parts = []
    if missing:
        parts.append(f"missing keys ({len(missing)}): {', '.join(map(repr, missing))}")
    if unexpected:
        parts.append(f"unexpected keys ({len(unexpected)}): {', '.join(map(repr, unexpected))}")
    for name, file_shape, target_shape in plan.mismatched:
        parts.append(f"size mismatch for {name!r}: the checkpoint has shape {list(file_shape)}, "
                     f"the target {list(target_shape)}")
    for name, file_dtype, target_dtype in plan.unconvertible:
        parts.append(f"dtype for {name!r}: Tensor.copy_ cannot convert the checkpoint's {file_dtype} "
                     f"to the target's {target_dtype}")
    hint = "; pass strict=False to load the matching keys only" if missing or unexpected else ""
    return CheckpointMismatchError("the checkpoint does not fit the target (nothing was loaded): "
                                   + "; ".join(parts) + hint, missing_keys=plan.missing,
                                   unexpected_keys=plan.unexpected, mismatched=plan.mismatched,
                                   unconvertible=[(n, str(a), str(b)) for n, a, b in plan.unconvertible])


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
