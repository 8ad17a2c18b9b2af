"""``deepnvme plan --params``: the NVMe storage a training job needs, from byte counts.

Mixed-precision Adam with ZeRO, ``P`` parameters of ``d`` bytes (bf16/fp16: 2, fp32: 4),
``R`` data-parallel ranks; GB = 1e9 bytes. What lives on NVMe:

- optimizer offloaded: its state, ``12 P`` (fp32 master weights 4 + Adam m 4 + v 4), and the
  fp32 gradients it steps with, ``4 P``; partitioned over the ranks from ZeRO stage 1 (each
  rank holds ``16 P / R``), whole on every rank at stage 0 (``16 P R`` in all);
- parameters offloaded: ``d P``, partitioned at stage 3, whole on every rank below it;
- checkpoints: ``P (d + 12)`` each (parameters in their dtype + optimizer state), ``keep + 1``
  of them at the peak (the kept ones and the one being written).

Traffic per step (all ranks): the optimizer reads and writes its state and gradients once
(``16 P`` read, ``16 P`` written: gradients are written in backward, read by the step); offloaded
parameters are read in forward and again in backward (``2 d P``) and written once after the
step (``d P``). Bandwidth = (read + written) / step time, plus the average checkpoint write
``P (d + 12) / (every x step time)``. Drives: ``ceil(bandwidth / drive GB/s)`` and
``ceil(capacity / drive size)``, the larger; one checkpoint takes ``P (d + 12) / (drives x
drive GB/s)``. One figure per drive serves reads and writes (give the write speed, the lower).

DeepSpeed's swap buffers are pinned host memory, not NVMe, per rank: parameters
``buffer_count x buffer_size`` elements of ``d`` bytes (defaults 5 x 1e8); optimizer
``buffer_count x min(sub_group_size, P / R)`` fp32 elements (defaults 4 and 1e9): DeepSpeed's
optimizer swapper pins ``buffer_count`` buffers of its largest sub-group's partition, in the
master-weight dtype (fp32). A sub-group closes at the first parameter that brings it to
``sub_group_size``, so with partitions as large as a sub-group the largest can exceed it by up
to one partition: the figure is then a lower bound (checked against DeepSpeed 0.19.8's stage 3).
Not counted: activations, activation checkpoints, fp16 gradients in GPU memory, file padding.
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = ["DTYPE_BYTES", "StorageSizing", "explain", "parse_count", "size_storage"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OPTIMIZER_BYTES = 12  # fp32 master weights + Adam m + Adam v, per parameter
GRADIENT_BYTES = 4  # fp32 gradient per parameter, beside the offloaded optimizer state
PARAM_BUFFER_COUNT, PARAM_BUFFER_SIZE = 5, 100_000_000  # DeepSpeed offload_param defaults
OPTIMIZER_BUFFER_COUNT, SUB_GROUP_SIZE = 4, 1_000_000_000  # offload_optimizer, sub_group_size
GB = 1e9

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_COUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMBGT]?)\s*$", re.I)


def parse_count(text: str) -> int:
    """``"7B"`` -> 7_000_000_000: a parameter count with a decimal K/M/B(G)/T suffix."""
    m = _COUNT.match(text)
    if not m:
        raise ValueError(f"expected a parameter count such as 7B, 350M or 1.5T, got {text!r}")
    value = round(float(m.group(1)) * _SUFFIX[m.group(2).upper()])
    if value < 1:
        raise ValueError(f"a parameter count must be at least 1, got {text!r}")
    return value


@dataclasses.dataclass(frozen=True)
class StorageSizing:
    """Bytes, GB/s, seconds and drive counts for one job (module docstring); None where an
    input it needs was not given. Byte counts cover all ranks unless named per rank."""

    params: int
    dtype: str
    zero_stage: int
    ranks: int
    offload_optimizer: bool
    offload_params: bool
    keep: int
    optimizer_state_bytes: int  # 12 P (x R at stage 0); 0 when the optimizer stays in memory
    gradient_bytes: int  # 4 P, alongside the optimizer state
    param_bytes: int  # d P (x R below stage 3); 0 when parameters stay in memory
    offload_bytes: int  # the three above
    checkpoint_bytes: int  # P (d + 12)
    checkpoint_store_bytes: int  # (keep + 1) x checkpoint_bytes
    capacity_bytes: int  # offload_bytes + checkpoint_store_bytes
    read_bytes_per_step: int
    write_bytes_per_step: int
    param_buffer_bytes: int  # pinned host memory per rank (DeepSpeed's parameter swap pool)
    optimizer_buffer_bytes: int  # pinned host memory per rank (optimizer swap buffers)
    step_seconds: float | None = None
    checkpoint_every: int | None = None
    drive_gbps: float | None = None
    drive_bytes: int | None = None
    offload_gbps: float | None = None  # (read + write per step) / step_seconds
    checkpoint_gbps: float | None = None  # checkpoint_bytes / (every x step_seconds)
    needed_gbps: float | None = None  # offload_gbps + checkpoint_gbps (those known)
    drives_for_bandwidth: int | None = None
    drives_for_capacity: int | None = None
    drives: int | None = None  # the larger of the two
    checkpoint_seconds: float | None = None  # on `drives` drives (one when no count is known)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


def _check(params: int, dtype: str, zero_stage: int, ranks: int, keep: int,
           numbers: dict[str, float | int | None]) -> None:
    if params < 1 or ranks < 1 or keep < 0:
        raise ValueError(f"size_storage: params and ranks must be >= 1 and keep >= 0, got "
                         f"{params}, {ranks}, {keep}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"size_storage: dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"size_storage: zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    for name, value in numbers.items():
        if value is not None and not value > 0:
            raise ValueError(f"size_storage: {name} must be > 0, got {value!r}")


def size_storage(*, params: int, dtype: str = "bf16", zero_stage: int = 3, ranks: int = 1,
                 offload_optimizer: bool = True, offload_params: bool = False, keep: int = 3,
                 step_seconds: float | None = None, checkpoint_every: int | None = None,
                 drive_gbps: float | None = None, drive_bytes: int | None = None) -> StorageSizing:
    """The storage one job needs (module docstring). ``keep``: checkpoints kept (the
    CheckpointManager's default 3); the ``step_seconds``, ``checkpoint_every``,
    ``drive_gbps`` (one drive's speed) and ``drive_bytes`` (its size) are optional."""
    _check(params, dtype, zero_stage, ranks, keep,
           {"step_seconds": step_seconds, "checkpoint_every": checkpoint_every,
            "drive_gbps": drive_gbps, "drive_bytes": drive_bytes})
    d = DTYPE_BYTES[dtype]
    opt_copies = 1 if zero_stage >= 1 else ranks  # partitioned from stage 1, else on every rank
    param_copies = 1 if zero_stage == 3 else ranks
    state = OPTIMIZER_BYTES * params * opt_copies if offload_optimizer else 0
    grads = GRADIENT_BYTES * params * opt_copies if offload_optimizer else 0
    weights = d * params * param_copies if offload_params else 0
    offload = state + grads + weights
    ckpt = params * (d + OPTIMIZER_BYTES)
    store = (keep + 1) * ckpt
    read = state + grads + 2 * weights
    write = state + grads + weights
    share = math.ceil(params / ranks) if zero_stage >= 1 else params
    sizing = StorageSizing(
        params=params, dtype=dtype, zero_stage=zero_stage, ranks=ranks,
        offload_optimizer=offload_optimizer, offload_params=offload_params, keep=keep,
        optimizer_state_bytes=state, gradient_bytes=grads, param_bytes=weights,
        offload_bytes=offload, checkpoint_bytes=ckpt, checkpoint_store_bytes=store,
        capacity_bytes=offload + store, read_bytes_per_step=read, write_bytes_per_step=write,
        param_buffer_bytes=PARAM_BUFFER_COUNT * PARAM_BUFFER_SIZE * d if offload_params else 0,
        optimizer_buffer_bytes=(OPTIMIZER_BUFFER_COUNT * min(SUB_GROUP_SIZE, share) * 4
                                if offload_optimizer else 0),
        step_seconds=step_seconds, checkpoint_every=checkpoint_every, drive_gbps=drive_gbps,
        drive_bytes=drive_bytes)
    return _with_drives(sizing)


def _with_drives(s: StorageSizing) -> StorageSizing:
    """Fill in the bandwidth and the drive counts from what is known."""
    offload_gbps = ckpt_gbps = None
    if s.step_seconds is not None:
        offload_gbps = (s.read_bytes_per_step + s.write_bytes_per_step) / s.step_seconds / GB
        if s.checkpoint_every is not None:
            ckpt_gbps = s.checkpoint_bytes / (s.checkpoint_every * s.step_seconds) / GB
    known = [g for g in (offload_gbps, ckpt_gbps) if g is not None]
    needed = sum(known) if known else None
    by_bw = by_cap = None
    if s.drive_gbps is not None and needed is not None:
        by_bw = max(1, math.ceil(needed / s.drive_gbps - 1e-9))
    if s.drive_bytes is not None:
        by_cap = max(1, math.ceil(s.capacity_bytes / s.drive_bytes))
    counts = [c for c in (by_bw, by_cap) if c is not None]
    drives = max(counts) if counts else None
    seconds = (s.checkpoint_bytes / ((drives or 1) * s.drive_gbps * GB)
               if s.drive_gbps is not None else None)
    return dataclasses.replace(s, offload_gbps=offload_gbps, checkpoint_gbps=ckpt_gbps,
                               needed_gbps=needed, drives_for_bandwidth=by_bw,
                               drives_for_capacity=by_cap, drives=drives, checkpoint_seconds=seconds)


def explain(s: StorageSizing) -> list[str]:
    """Where each number comes from, one line each, with the inputs written in."""
    P, d, gb = f"{s.params:,}", s.dtype_bytes, _gb
    opt_where = (f"partitioned over {s.ranks} rank(s)" if s.zero_stage >= 1
                 else f"x {s.ranks} ranks (stage 0: every rank holds it all)")
    par_where = (f"partitioned over {s.ranks} rank(s)" if s.zero_stage == 3
                 else f"x {s.ranks} rank(s) (below stage 3 every rank holds them all)")
    lines = [f"NVMe capacity: {gb(s.capacity_bytes)}"]
    if s.offload_optimizer:
        lines += [f"  optimizer state {gb(s.optimizer_state_bytes)} = {P} params x 12 B (fp32 "
                  f"master 4 + Adam m 4 + v 4), {opt_where}",
                  f"  fp32 gradients  {gb(s.gradient_bytes)} = {P} x 4 B, beside the optimizer state"]
    if s.offload_params:
        lines.append(f"  parameters      {gb(s.param_bytes)} = {P} x {d} B ({s.dtype}), {par_where}")
    lines.append(f"  checkpoints     {gb(s.checkpoint_store_bytes)} = (keep {s.keep} + 1 being "
                 f"written) x {gb(s.checkpoint_bytes)}")
    if s.ranks > 1:
        lines.append(f"  per rank: {gb(s.offload_bytes / s.ranks)} offloaded, "
                     f"{gb(s.checkpoint_store_bytes / s.ranks)} of checkpoints; drives below count "
                     "all ranks together")
    lines.append(f"offload traffic per step: read {gb(s.read_bytes_per_step)}, write "
                 f"{gb(s.write_bytes_per_step)}")
    if s.offload_optimizer:
        lines.append("  optimizer: state (12 B) and fp32 gradient (4 B) per parameter, each read "
                     "once and written once per step")
    if s.offload_params:
        lines.append(f"  parameters: read twice ({d} B in forward, {d} B in backward), written "
                     f"once ({d} B after the step)")
    if s.offload_gbps is not None:
        lines.append(f"  at {s.step_seconds:g} s per step: {s.offload_gbps:.2f} GB/s "
                     f"({s.offload_gbps / s.ranks:.2f} GB/s per rank)")
    lines.append(f"checkpoint: {gb(s.checkpoint_bytes)} = {P} x ({d} B parameters + 12 B "
                 "optimizer state)")
    if s.checkpoint_gbps is not None and s.checkpoint_every and s.step_seconds:
        lines.append(f"  every {s.checkpoint_every} steps ({s.checkpoint_every * s.step_seconds:g} s):"
                     f" {s.checkpoint_gbps:.3f} GB/s on average")
    lines += _drive_lines(s)
    lines.append(f"pinned host memory per rank for DeepSpeed's swap buffers: parameters "
                 f"{PARAM_BUFFER_COUNT} x {PARAM_BUFFER_SIZE:,} elements x {d} B = "
                 f"{gb(s.param_buffer_bytes)}; optimizer {OPTIMIZER_BUFFER_COUNT} x min(sub_group_size "
                 f"{SUB_GROUP_SIZE:,}, P / R) x 4 B = {gb(s.optimizer_buffer_bytes)} (defaults; "
                 "buffer_count, buffer_size and sub_group_size change them)")
    lines.append("not counted: activations and their checkpoints, GPU memory, file padding")
    return lines


def _gb(n: float) -> str:
    return f"{n / GB:,.1f} GB"


def _drive_lines(s: StorageSizing) -> list[str]:
    fmt = _gb
    if s.drive_gbps is None:
        return ["drives: give --drive-gbps (or --measure DIR) to count them"]
    size = f", {fmt(s.drive_bytes)}" if s.drive_bytes is not None else ""
    parts = []
    if s.drives_for_bandwidth is not None:
        parts.append(f"{s.drives_for_bandwidth} for bandwidth ({s.needed_gbps:.2f} GB/s)")
    if s.drives_for_capacity is not None:
        parts.append(f"{s.drives_for_capacity} for capacity ({fmt(s.capacity_bytes)})")
    lines = [f"drives of {s.drive_gbps:.2f} GB/s{size}: " + (", ".join(parts) or "no count "
             "(give --step-seconds and --drive-tb)") + (f" -> {s.drives}" if s.drives else "")]
    if s.checkpoint_seconds is not None:
        lines.append(f"  one checkpoint on {s.drives or 1} drive(s): {s.checkpoint_seconds:.2f} s "
                     f"({s.checkpoint_bytes / (s.drive_gbps * GB):.2f} s on one)")
    return lines
