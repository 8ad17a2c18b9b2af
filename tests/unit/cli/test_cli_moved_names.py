"""The measuring names that moved from deepnvme.cli to deepnvme.bench still import from the
old place for one release, warning once per name."""

from __future__ import annotations

import warnings

import pytest

import deepnvme.bench
import deepnvme.cli
from deepnvme import _deprecation


def test_old_names_are_the_new_objects_and_warn_once(monkeypatch) -> None:
    monkeypatch.setattr(_deprecation, "_warned", set())
    for name in ("run_bench", "BenchOptions", "LoadOptions", "run_load_bench", "run_tune",
                 "run_report", "run_data_bench"):
        with pytest.warns(DeprecationWarning, match=f"deepnvme.cli.{name} moved to deepnvme.bench.{name}"):
            old = getattr(deepnvme.cli, name)
        assert old is getattr(deepnvme.bench, name)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert getattr(deepnvme.cli, name) is old  # the second use is silent


def test_from_import_still_works_and_unknown_names_fail(monkeypatch) -> None:
    monkeypatch.setattr(_deprecation, "_warned", set())
    with pytest.warns(DeprecationWarning):
        from deepnvme.cli import LoadBenchResult
    assert LoadBenchResult is deepnvme.bench.LoadBenchResult
    from deepnvme.cli import main  # submodules import as before, without a warning
    assert callable(main.main)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        deepnvme.cli.nothing  # noqa: B018
