"""The ``deepnvme`` command line: thin argument parsing over functions that return dataclasses.

The functions behind the subcommands are usable from Python too (they print nothing):
:func:`run_report`, :func:`run_bench`, :func:`run_load_bench`, :func:`run_data_bench` and
:func:`run_tune`. The console script's entry
point is ``deepnvme.cli.main:main``.
"""

from .bench import BenchOptions, BenchResult, OpStats, run_bench
from .bench_data import DataBenchResult, DataOptions, run_data_bench
from .bench_load import LoadBenchResult, LoadOptions, run_load_bench
from .report import Check, Report, run_report
from .tune import Trial, TuneResult, TuneSpace, default_space, load_space, run_tune

__all__ = [
    "BenchOptions",
    "BenchResult",
    "Check",
    "DataBenchResult",
    "DataOptions",
    "LoadBenchResult",
    "LoadOptions",
    "OpStats",
    "Report",
    "Trial",
    "TuneResult",
    "TuneSpace",
    "default_space",
    "load_space",
    "run_bench",
    "run_data_bench",
    "run_load_bench",
    "run_report",
    "run_tune",
]
