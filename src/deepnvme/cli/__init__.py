"""The ``deepnvme`` command line: parse the arguments, call :mod:`deepnvme.bench` (or the
feature a command serves), render the result. The console script's entry point is
``deepnvme.cli.main:main``.

The measuring functions that used to be imported from here (``run_bench``, ``BenchOptions``,
...) live in :mod:`deepnvme.bench`; the old names still work for one release and warn once.
"""

from __future__ import annotations

from typing import Any

from .._deprecation import warn_once

__all__: list[str] = []

# old name -> where it lives now (all in deepnvme.bench)
_MOVED = ("BenchOptions", "BenchResult", "Check", "DataBenchResult", "DataOptions",
          "LoadBenchResult", "LoadOptions", "OpStats", "Report", "Trial", "TuneResult",
          "TuneSpace", "default_space", "load_space", "run_bench", "run_data_bench",
          "run_load_bench", "run_report", "run_tune")


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .. import bench

    warn_once(f"deepnvme.cli.{name}", f"deepnvme.cli.{name} moved to deepnvme.bench.{name}; import it from "
              "there (the old name goes in the next release)", stacklevel=2)
    return getattr(bench, name)
