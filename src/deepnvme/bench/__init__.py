"""Measuring the storage path and choosing settings: what the ``deepnvme`` commands run.

Each function is blocking, prints nothing, and returns a frozen dataclass (with ``to_dict()``
for JSON): :func:`run_report` (is this environment usable?), :func:`run_bench` (write and
cold-read GB/s against plain Python and fio), :func:`run_load_bench` (checkpoint readers on a
checkpoint), :func:`run_data_bench` (token-dataset readers), :func:`run_tune` (the best handle
settings), :func:`run_storage_report` (what to change in the storage under a path),
:func:`plan_interval` with :func:`checkpoint_size` and :func:`measure_write_gbps`
(how often to checkpoint), :func:`size_storage` (the NVMe storage a model's training
needs). GB means 1e9 bytes throughout.
"""

from ._storage_types import BenchOptions, BenchResult, OpStats
from ._tune_space import TuneSpace, default_space, load_space
from ._units import Stats
from .data import DataBenchResult, DataOptions, run_data_bench
from .interval import CheckpointPlan, CheckpointSize, checkpoint_size, measure_write_gbps, plan_interval
from .load import LoadBenchResult, LoadOptions, run_load_bench
from .report import Check, Report, run_report
from .sizing import StorageSizing, parse_count, size_storage
from .storage import run_bench
from .storage_report import StorageReport, run_storage_report
from .tune import Trial, TuneInterrupted, TuneResult, run_tune

__all__ = [
    "BenchOptions",
    "BenchResult",
    "Check",
    "CheckpointPlan",
    "CheckpointSize",
    "DataBenchResult",
    "DataOptions",
    "LoadBenchResult",
    "LoadOptions",
    "OpStats",
    "Report",
    "Stats",
    "StorageReport",
    "StorageSizing",
    "Trial",
    "TuneInterrupted",
    "TuneResult",
    "TuneSpace",
    "checkpoint_size",
    "default_space",
    "load_space",
    "measure_write_gbps",
    "parse_count",
    "plan_interval",
    "run_bench",
    "run_data_bench",
    "run_load_bench",
    "run_report",
    "run_storage_report",
    "run_tune",
    "size_storage",
]
