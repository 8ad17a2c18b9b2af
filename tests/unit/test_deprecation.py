"""The one-release aliases: a warning once per name, then the new behaviour."""

import sys
import types
import warnings

import pytest

from deepnvme import _deprecation


@pytest.fixture(autouse=True)
def fresh_ledger(monkeypatch):
    monkeypatch.setattr(_deprecation, "_warned", set())


def _count(record):
    return sum(issubclass(w.category, DeprecationWarning) for w in record)


def test_warn_once_warns_at_the_first_call_only():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert _deprecation.warn_once("k", "old k") is True
        assert _deprecation.warn_once("k", "old k") is False
        assert _deprecation.warn_once("j", "old j") is True
    assert [str(w.message) for w in record] == ["old k", "old j"]


def test_module_aliases(monkeypatch):
    mod = types.ModuleType("fake_mod")
    mod.new = object()
    mod.__getattr__ = _deprecation.module_aliases("fake_mod", {"old": "new"})
    monkeypatch.setitem(sys.modules, "fake_mod", mod)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert mod.old is mod.new and mod.old is mod.new
    assert _count(record) == 1 and "fake_mod.old is deprecated" in str(record[0].message)
    with pytest.raises(AttributeError, match="'fake_mod' has no attribute 'other'"):
        mod.other  # noqa: B018


def test_renamed_keywords():
    @_deprecation.renamed_keywords(before="after")
    def f(x, *, after=0):
        """Doc."""
        return x + after

    assert f.__name__ == "f" and f.__doc__ == "Doc."
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert f(1, after=2) == 3
        assert _count(record) == 0
        assert f(1, before=2) == 3 and f(1, before=5) == 6
    assert _count(record) == 1 and "before= is deprecated" in str(record[0].message)
    assert "use after=" in str(record[0].message)
    with pytest.raises(TypeError, match="both before= .* and after="):
        f(1, before=1, after=2)
