"""``deepnvme plan``: how often to checkpoint, from the save time, the step time and the MTBF.

Young/Daly: with blocking saves of ``C`` seconds and a mean time between failures ``M``, the
interval that minimises the expected lost time is ``sqrt(2 C M)`` of compute; the expected
fraction of wall time lost is ``C / T + T / (2 M)`` at interval ``T`` (saving, plus on average
half an interval of rework per failure; restart time not counted). Asynchronous saves
(CheckpointManager) hide the write behind compute as long as one save finishes before the next
starts: ``overlap_min_interval_steps = ceil(C / step)``, and at or above it only rework is lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
from typing import Any

from ..config import checkpoint_config
from ..io.durable import create_temp, remove_quietly
from ..memory.views import aligned_empty
from ._args import positive_float
from ._measure import Measurer, fill_pattern
from ._render import GB, print_json, progress_bar

__all__ = ["CheckpointPlan", "plan_interval", "measure_write_gbps", "add_plan_parser"]

_MEASURE_MAX = 1 << 30  # --measure writes min(checkpoint size, 1 GiB), 3 times


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """The checkpoint interval for one job (seconds, hours, steps; GB = 1e9 bytes)."""

    checkpoint_gb: float
    write_gbps: float
    step_seconds: float
    mtbf_hours: float
    save_seconds: float  # one save written at write_gbps
    optimal_interval_seconds: float  # Young/Daly sqrt(2 x save x MTBF), before rounding to steps
    interval_steps: int  # the optimum in whole steps (>= 1)
    interval_hours: float  # interval_steps x step_seconds
    overhead_fraction: float  # blocking saves: save / interval + interval / (2 MTBF)
    rework_hours_per_failure: float  # half an interval
    overlap_min_interval_steps: int  # below this, a background save is still writing at the next one
    overlapped_overhead_fraction: float  # overlapped saves every overlap_min_interval_steps: rework only


def plan_interval(*, checkpoint_gb: float, write_gbps: float, step_seconds: float,
                  mtbf_hours: float) -> CheckpointPlan:
    """The Young/Daly plan (module docstring); every input must be > 0."""
    for name, value in (("checkpoint_gb", checkpoint_gb), ("write_gbps", write_gbps),
                        ("step_seconds", step_seconds), ("mtbf_hours", mtbf_hours)):
        if not value > 0:
            raise ValueError(f"plan_interval: {name} must be > 0, got {value!r}")
    save = checkpoint_gb / write_gbps
    mtbf = mtbf_hours * 3600.0
    optimal = math.sqrt(2.0 * save * mtbf)
    steps = max(1, round(optimal / step_seconds))
    interval = steps * step_seconds
    overlap = max(1, math.ceil(save / step_seconds - 1e-9))
    return CheckpointPlan(
        checkpoint_gb=checkpoint_gb, write_gbps=write_gbps, step_seconds=step_seconds,
        mtbf_hours=mtbf_hours, save_seconds=save, optimal_interval_seconds=optimal,
        interval_steps=steps, interval_hours=interval / 3600.0,
        overhead_fraction=save / interval + interval / (2.0 * mtbf),
        rework_hours_per_failure=interval / 2.0 / 3600.0, overlap_min_interval_steps=overlap,
        overlapped_overhead_fraction=overlap * step_seconds / (2.0 * mtbf))


def measure_write_gbps(directory: str, nbytes: int, *, repeats: int = 3, progress: bool = False) -> float:
    """Median GB/s of writing ``nbytes`` to a new file in ``directory`` through deepnvme's engine,
    timed until fsync returns; the file is deleted after. Memory: one ``nbytes`` buffer."""
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"--measure {directory!r}: not a directory")
    nbytes = max(4096, nbytes - nbytes % 4096)
    buf = aligned_empty(nbytes)
    fill_pattern(buf, 15)
    path = create_temp(directory, "deepnvme-plan-measure")
    measurer = Measurer(path=path, buf=buf, config=checkpoint_config(None))
    try:
        seconds = []
        with progress_bar(f"measuring writes in {directory}", repeats, enabled=progress) as bar:
            for _ in range(repeats):
                seconds.append(measurer.measure("deepnvme", write=True).seconds)
                if bar is not None:
                    bar.advance(bar.task_ids[0])
    finally:
        measurer.close()
        remove_quietly(path)
    return nbytes / statistics.median(seconds) / GB


def _render(plan: CheckpointPlan) -> str:
    return "\n".join([
        f"checkpoint {plan.checkpoint_gb:g} GB at {plan.write_gbps:.2f} GB/s: one save takes {plan.save_seconds:.2f} s",
        f"optimal interval (Young/Daly, sqrt(2 x save x MTBF)): {plan.interval_steps} steps "
        f"= {plan.interval_hours:.3f} h ({plan.optimal_interval_seconds:.0f} s before rounding)",
        f"expected overhead with blocking saves: {plan.overhead_fraction:.2%} of wall time "
        f"(saving + rework; {plan.rework_hours_per_failure:.3f} h rework per failure)",
        f"asynchronous saves overlap compute fully at intervals >= {plan.overlap_min_interval_steps} "
        f"step(s); saving that often loses only rework: {plan.overlapped_overhead_fraction:.3%}",
    ])


def _plan(args: argparse.Namespace) -> int:
    if args.measure is not None:
        nbytes = min(int(args.checkpoint_gb * GB), _MEASURE_MAX)
        gbps = measure_write_gbps(args.measure, nbytes, progress=not args.json)
    else:
        gbps = args.write_gbps
    plan = plan_interval(checkpoint_gb=args.checkpoint_gb, write_gbps=gbps,
                         step_seconds=args.step_seconds, mtbf_hours=args.mtbf_hours)
    if args.json:
        print_json(dataclasses.asdict(plan))
    else:
        print(_render(plan))
    return 0


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``deepnvme plan``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan", help="checkpoint interval from save time, step time and MTBF (Young/Daly)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint-gb", type=positive_float, required=True, metavar="G",
                   help="checkpoint size in GB (1e9 bytes)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--write-gbps", type=positive_float, metavar="B", help="write speed in GB/s")
    src.add_argument("--measure", metavar="DIR",
                     help="measure the write speed in DIR (writes, fsyncs and deletes min(G, 1 GiB))")
    p.add_argument("--step-seconds", type=positive_float, required=True, metavar="S",
                   help="seconds per training step")
    p.add_argument("--mtbf-hours", type=positive_float, required=True, metavar="H",
                   help="mean time between failures of the job, hours")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)
    return p
