"""``deepnvme plan``: how often to checkpoint, from the save time, the step time and the MTBF;
with ``--params``, the NVMe storage a model's training needs.

Parses the options, sizes the checkpoint (``--checkpoint-gb``, or from disk with
:func:`~deepnvme.bench.checkpoint_size`), takes or measures the write speed, and prints
:func:`~deepnvme.bench.plan_interval`'s plan (the arithmetic is in :mod:`deepnvme.bench.interval`).
``--params`` prints :func:`~deepnvme.bench.size_storage` instead (:mod:`deepnvme.bench.sizing`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..bench import CheckpointPlan, CheckpointSize, checkpoint_size, measure_write_gbps, plan_interval
from ..bench.interval import MEASURE_MAX
from ..bench.sizing import DTYPE_BYTES, StorageSizing, explain, parse_count, size_storage
from ..errors import UsageError
from ._args import nonnegative_int, positive_float, positive_int
from ._render import GB, print_json, progress_bar

__all__ = ["add_plan_parser", "render_plan", "plan_interval"]

_DESCRIPTION = """\
How often to checkpoint, from the save time, the step time and the MTBF.

Young/Daly: with blocking saves of C seconds and a mean time between failures M, the interval
that minimises the expected lost time is sqrt(2 C M) of compute; the expected fraction of wall
time lost is C / T + T / (2 M) at interval T (saving, plus on average half an interval of
rework per failure; restart time not counted). Asynchronous saves (CheckpointManager) hide the
write behind compute as long as one save finishes before the next starts: at intervals of
ceil(C / step) steps or more only rework is lost.

The checkpoint size is --checkpoint-gb, or --checkpoint PATH: a file's size, the files of the
latest committed step of a CheckpointManager folder, or every file of another checkpoint
folder (one step, a Hugging Face or DCP checkpoint).

--params N sizes storage for a model instead (no --checkpoint-gb): NVMe capacity, the
bandwidth the offload needs per step, checkpoint size and time, and the drives that takes,
with where each number comes from (mixed-precision Adam: 12 B of optimizer state and 4 B of
fp32 gradient per parameter, parameters in their dtype). With --mtbf-hours it also plans the
interval for that checkpoint on those drives."""

_OFFLOAD = ("optimizer", "params")


def render_plan(plan: CheckpointPlan, size: CheckpointSize | None = None) -> str:
    """The plan for people, one finding per line (with where the size came from, if read)."""
    lines = []
    if size is not None:
        step = f" (step {size.step})" if size.step is not None else ""
        lines.append(f"checkpoint size from {size.path}{step}: {size.nbytes} bytes in {size.files} "
                     f"file{'' if size.files == 1 else 's'}")
    return "\n".join(lines + [
        f"checkpoint {plan.checkpoint_gb:g} GB at {plan.write_gbps:.2f} GB/s: one save takes {plan.save_seconds:.2f} s",
        f"optimal interval (Young/Daly, sqrt(2 x save x MTBF)): {plan.interval_steps} steps "
        f"= {plan.interval_hours:.3f} h ({plan.optimal_interval_seconds:.0f} s before rounding)",
        f"expected overhead with blocking saves: {plan.overhead_fraction:.2%} of wall time "
        f"(saving + rework; {plan.rework_hours_per_failure:.3f} h rework per failure)",
        f"asynchronous saves overlap compute fully at intervals >= {plan.overlap_min_interval_steps} "
        f"step(s); saving that often loses only rework: {plan.overlapped_overhead_fraction:.3%}",
    ])


def _measure(directory: str, checkpoint_gb: float, quiet: bool) -> float:
    nbytes = min(int(checkpoint_gb * GB), MEASURE_MAX)
    with progress_bar(f"measuring writes in {directory}", 3, enabled=not quiet) as bar:
        return measure_write_gbps(directory, nbytes, repeats=3, progress=bar)


def _plan(args: argparse.Namespace) -> int:
    if args.params is not None:
        return _size(args)
    for flag in ("dtype", "zero_stage", "offload", "ranks", "drive_gbps", "drive_tb",
                 "checkpoint_every", "keep"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} goes with --params (sizing storage for a model)")
    if args.checkpoint is None and args.checkpoint_gb is None:
        raise UsageError("one of the arguments --checkpoint-gb --checkpoint is required "
                         "(or --params N to size storage for a model)")
    if args.write_gbps is None and args.measure is None:
        raise UsageError("one of the arguments --write-gbps --measure is required")
    for flag in ("step_seconds", "mtbf_hours"):
        if getattr(args, flag) is None:
            raise UsageError(f"the following arguments are required: --{flag.replace('_', '-')}")
    size = checkpoint_size(args.checkpoint) if args.checkpoint is not None else None
    checkpoint_gb = size.gb if size is not None else args.checkpoint_gb
    gbps = _measure(args.measure, checkpoint_gb, args.json) if args.measure else args.write_gbps
    plan = plan_interval(checkpoint_gb=checkpoint_gb, write_gbps=gbps,
                         step_seconds=args.step_seconds, mtbf_hours=args.mtbf_hours)
    if args.json:
        print_json({**dataclasses.asdict(plan),
                    "checkpoint": None if size is None else dataclasses.asdict(size)})
    else:
        print(render_plan(plan, size))
    return 0


def _offload(text: str | None) -> tuple[bool, bool]:
    """``--offload optimizer,params`` (or ``none``) as (optimizer, params)."""
    words = {w.strip() for w in (text or "optimizer").split(",") if w.strip()}
    if words == {"none"}:
        return False, False
    unknown = words - set(_OFFLOAD)
    if unknown or not words:
        raise UsageError(f"--offload takes optimizer, params (comma-separated) or none, got {text!r}")
    return "optimizer" in words, "params" in words


def _size(args: argparse.Namespace) -> int:
    for flag in ("checkpoint", "checkpoint_gb", "write_gbps"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} does not go with --params (which sizes "
                             "the checkpoint itself; give one drive's speed with --drive-gbps)")
    try:
        params = parse_count(args.params)
    except ValueError as exc:
        raise UsageError(f"--params: {exc}") from None
    optimizer, parameters = _offload(args.offload)
    keep = 3 if args.keep is None else args.keep
    dtype = args.dtype or "bf16"
    drive_gbps = args.drive_gbps
    if args.measure is not None:
        drive_gbps = _measure(args.measure, params * (DTYPE_BYTES[dtype] + 12) / GB, args.json)
    sizing = size_storage(
        params=params, dtype=dtype, zero_stage=3 if args.zero_stage is None else args.zero_stage,
        ranks=args.ranks or 1, offload_optimizer=optimizer, offload_params=parameters, keep=keep,
        step_seconds=args.step_seconds, checkpoint_every=args.checkpoint_every,
        drive_gbps=drive_gbps, drive_bytes=None if args.drive_tb is None else round(args.drive_tb * 1e12))
    interval = _interval(sizing, args.mtbf_hours)
    if args.json:
        print_json({**dataclasses.asdict(sizing), "explain": explain(sizing),
                    "interval": None if interval is None else dataclasses.asdict(interval)})
    else:
        print(render_sizing(sizing, interval))
    return 0


def _interval(s: StorageSizing, mtbf_hours: float | None) -> CheckpointPlan | None:
    """Young/Daly for the model's checkpoint on the planned drives, where everything is known."""
    if mtbf_hours is None or s.step_seconds is None or s.drive_gbps is None:
        return None
    return plan_interval(checkpoint_gb=s.checkpoint_bytes / GB, write_gbps=s.drive_gbps * (s.drives or 1),
                         step_seconds=s.step_seconds, mtbf_hours=mtbf_hours)


def render_sizing(s: StorageSizing, interval: CheckpointPlan | None = None) -> str:
    """The sizing for people: the inputs, then where every number comes from."""
    offloaded = ", ".join(n for n, on in zip(_OFFLOAD, (s.offload_optimizer, s.offload_params)) if on)
    lines = [f"model: {s.params:,} parameters, {s.dtype}, ZeRO stage {s.zero_stage}, {s.ranks} "
             f"rank(s); on NVMe: {offloaded or 'nothing offloaded (checkpoints only)'}"]
    if s.offload_params and s.zero_stage < 3:
        lines.append("note: DeepSpeed offloads parameters only at ZeRO stage 3; below it every "
                     "rank keeps (and here offloads) all of them")
    lines += explain(s)
    if interval is not None:
        lines += ["with --mtbf-hours, for this checkpoint on these drives:",
                  *("  " + line for line in render_plan(interval).splitlines())]
    return "\n".join(lines)


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``deepnvme plan``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan", help="checkpoint interval from save time, step time and MTBF (Young/Daly); "
                     "NVMe storage for a model (--params)",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--checkpoint-gb", type=positive_float, metavar="G",
                      help="checkpoint size in GB (1e9 bytes)")
    size.add_argument("--checkpoint", metavar="PATH",
                      help="size the checkpoint from disk: a checkpoint file, a CheckpointManager "
                           "folder (its latest committed step) or one checkpoint folder")
    size.add_argument("--params", metavar="N",
                      help="size NVMe storage for a model of N parameters (7B, 350M, 1.5T: "
                           "decimal K/M/B/T) instead of planning an interval")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--write-gbps", type=positive_float, metavar="B", help="write speed in GB/s")
    src.add_argument("--drive-gbps", type=positive_float, metavar="G",
                     help="with --params: one drive's speed in GB/s (its write speed)")
    src.add_argument("--measure", metavar="DIR",
                     help="measure the write speed in DIR (writes, fsyncs and deletes the "
                          "checkpoint size, at most 1 GiB); with --params, one drive's speed")
    p.add_argument("--step-seconds", type=positive_float, metavar="S",
                   help="seconds per training step")
    p.add_argument("--mtbf-hours", type=positive_float, metavar="H",
                   help="mean time between failures of the job, hours (optional with --params)")
    m = p.add_argument_group("sizing a model (with --params)")
    m.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="parameter dtype (default: bf16)")
    m.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3),
                   help="ZeRO stage: optimizer state partitioned over the ranks from 1, "
                        "parameters at 3 (default: 3)")
    m.add_argument("--offload", metavar="WHAT",
                   help="what lives on NVMe: optimizer, params, both comma-separated, or none "
                        "(default: optimizer)")
    m.add_argument("--ranks", type=positive_int, metavar="N",
                   help="data-parallel ranks sharing the state (default: 1)")
    m.add_argument("--checkpoint-every", type=positive_int, metavar="N",
                   help="steps between checkpoints (adds their average write to the bandwidth)")
    m.add_argument("--keep", type=nonnegative_int, metavar="K",
                   help="checkpoints kept on the drives (default: 3, CheckpointManager's)")
    m.add_argument("--drive-tb", type=positive_float, metavar="T",
                   help="one drive's size in TB (1e12 bytes), to count drives for capacity")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)
    return p
