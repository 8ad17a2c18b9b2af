"""``deepnvme plan``: how often to checkpoint, from the save time, the step time and the MTBF.

Parses the options, sizes the checkpoint (``--checkpoint-gb``, or from disk with
:func:`~deepnvme.bench.checkpoint_size`), takes or measures the write speed, and prints
:func:`~deepnvme.bench.plan_interval`'s plan (the arithmetic is in :mod:`deepnvme.bench.interval`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..bench import CheckpointPlan, CheckpointSize, checkpoint_size, measure_write_gbps, plan_interval
from ..bench.interval import MEASURE_MAX
from ._args import positive_float
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
folder (one step, a Hugging Face or DCP checkpoint)."""


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


def _plan(args: argparse.Namespace) -> int:
    size = checkpoint_size(args.checkpoint) if args.checkpoint is not None else None
    checkpoint_gb = size.gb if size is not None else args.checkpoint_gb
    if args.measure is not None:
        nbytes = min(int(checkpoint_gb * GB), MEASURE_MAX)
        with progress_bar(f"measuring writes in {args.measure}", 3, enabled=not args.json) as bar:
            gbps = measure_write_gbps(args.measure, nbytes, repeats=3, progress=bar)
    else:
        gbps = args.write_gbps
    plan = plan_interval(checkpoint_gb=checkpoint_gb, write_gbps=gbps,
                         step_seconds=args.step_seconds, mtbf_hours=args.mtbf_hours)
    if args.json:
        print_json({**dataclasses.asdict(plan),
                    "checkpoint": None if size is None else dataclasses.asdict(size)})
    else:
        print(render_plan(plan, size))
    return 0


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``deepnvme plan``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan", help="checkpoint interval from save time, step time and MTBF (Young/Daly)",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--checkpoint-gb", type=positive_float, metavar="G",
                      help="checkpoint size in GB (1e9 bytes)")
    size.add_argument("--checkpoint", metavar="PATH",
                      help="size the checkpoint from disk: a checkpoint file, a CheckpointManager "
                           "folder (its latest committed step) or one checkpoint folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--write-gbps", type=positive_float, metavar="B", help="write speed in GB/s")
    src.add_argument("--measure", metavar="DIR",
                     help="measure the write speed in DIR (writes, fsyncs and deletes the "
                          "checkpoint size, at most 1 GiB)")
    p.add_argument("--step-seconds", type=positive_float, required=True, metavar="S",
                   help="seconds per training step")
    p.add_argument("--mtbf-hours", type=positive_float, required=True, metavar="H",
                   help="mean time between failures of the job, hours")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)
    return p
