"""``deepnvme plan``: how often to checkpoint, from the save time, the step time and the MTBF.

Young/Daly: with blocking saves of ``C`` seconds and a mean time between failures ``M``, the
interval that minimises the expected lost time is ``sqrt(2 C M)`` of compute; the expected
fraction of wall time lost is ``C / T + T / (2 M)`` at interval ``T`` (saving, plus on average
half an interval of rework per failure; restart time not counted). Asynchronous saves
(CheckpointManager) hide the write behind compute as long as one save finishes before the next
starts: ``overlap_min_interval_steps = ceil(C / step)``, and at or above it only rework is lost.

The checkpoint size can be read from disk (:func:`checkpoint_size`): a file, one checkpoint
folder, or a CheckpointManager folder (its latest committed step).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from typing import Any

from ..checkpoint.manager._steps import find_step_dirs, list_steps
from ..config import checkpoint_config
from ..errors import UsageError
from ..io.durable import create_temp, remove_quietly
from ..memory.views import aligned_empty
from ._measure import Measurer, fill_pattern
from ._units import GB

__all__ = ["CheckpointPlan", "CheckpointSize", "plan_interval", "checkpoint_size",
           "measure_write_gbps", "MEASURE_MAX"]

MEASURE_MAX = 1 << 30  # measuring writes min(checkpoint size, 1 GiB), 3 times


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


def measure_write_gbps(directory: str, nbytes: int, *, repeats: int = 3, progress: Any = None) -> float:
    """Median GB/s of writing ``nbytes`` to a new file in ``directory`` through deepnvme's engine,
    timed until fsync returns; the file is deleted after; blocking. Memory: one ``nbytes``
    buffer. ``progress``: an optional rich ``Progress`` whose first task advances per write."""
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"--measure {directory!r}: not a directory")
    nbytes = max(4096, nbytes - nbytes % 4096)
    buf = aligned_empty(nbytes)
    fill_pattern(buf, 15)
    path = create_temp(directory, "deepnvme-plan-measure")
    measurer = Measurer(path=path, buf=buf, config=checkpoint_config(None))
    try:
        seconds = []
        for _ in range(repeats):
            seconds.append(measurer.measure("deepnvme", write=True).seconds)
            if progress is not None:
                progress.advance(progress.task_ids[0])
    finally:
        measurer.close()
        remove_quietly(path)
    return nbytes / statistics.median(seconds) / GB


@dataclasses.dataclass(frozen=True)
class CheckpointSize:
    """A checkpoint's size on disk: ``nbytes`` over ``files`` files under ``path``; ``step`` is
    the CheckpointManager step measured (None: ``path`` is one checkpoint file or folder)."""

    path: str
    nbytes: int
    files: int
    step: int | None = None

    @property
    def gb(self) -> float:
        return self.nbytes / GB


def _tree_size(path: str) -> tuple[int, int]:
    """(bytes, files) of the regular files under ``path``, hidden ones (temporary files of
    writes in progress) left out; symbolic links are not followed."""
    nbytes = files = 0
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            full = os.path.join(root, name)
            if name.startswith(".") or os.path.islink(full) or not os.path.isfile(full):
                continue
            nbytes += os.path.getsize(full)
            files += 1
    return nbytes, files


def checkpoint_size(path: str) -> CheckpointSize:
    """The size of the checkpoint at ``path``: a file's size; for a CheckpointManager folder
    (``step-N`` folders) the files of its latest committed step; for any other folder (one
    step, a Hugging Face or DCP checkpoint) every file in it. Raises :class:`UsageError` when
    there is nothing to size."""
    if os.path.isfile(path):
        size = os.path.getsize(path)
        if not size:
            raise UsageError(f"checkpoint {path!r} is an empty file")
        return CheckpointSize(path=path, nbytes=size, files=1)
    if not os.path.isdir(path):
        raise UsageError(f"checkpoint {path!r} does not exist; give a checkpoint file or folder")
    step = None
    where = path
    if find_step_dirs(path):
        committed = list_steps(path)
        if not committed:
            raise UsageError(f"checkpoint folder {path!r} has step-N folders but no committed step "
                             "(none holds its manifest); give one step folder instead")
        step = committed[-1]
        where = next(d for s, d in find_step_dirs(path) if s == step)
    nbytes, files = _tree_size(where)
    if not nbytes:
        raise UsageError(f"checkpoint folder {where!r} holds no data (no non-empty files)")
    return CheckpointSize(path=where, nbytes=nbytes, files=files, step=step)
