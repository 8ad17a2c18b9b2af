"""The package namespace: every exported name resolves; the training, inference and data halves
load on first use, not at ``import deepnvme``."""

from __future__ import annotations

import subprocess
import sys

import pytest

import deepnvme

LAZY_SUBPACKAGES = ("deepnvme.inference", "deepnvme.data", "deepnvme.offload", "deepnvme.optim",
                    "deepnvme.swap")


def test_every_exported_name_resolves() -> None:
    for name in deepnvme.__all__:
        assert getattr(deepnvme, name) is not None, name
    assert set(deepnvme.__all__) <= set(dir(deepnvme))


def test_lazy_names_are_the_subpackages_objects() -> None:
    from deepnvme.offload import offload_parameters
    from deepnvme.optim import NVMeOptimizer

    assert deepnvme.NVMeOptimizer is NVMeOptimizer
    assert deepnvme.offload_parameters is offload_parameters
    assert deepnvme.inference.__name__ == "deepnvme.inference"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        deepnvme.not_a_name  # noqa: B018


def test_import_does_not_load_the_lazy_subpackages() -> None:
    code = ("import sys, deepnvme; "
            f"print(','.join(m for m in {LAZY_SUBPACKAGES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
    code = "import sys; from deepnvme import NVMeOptimizer; print('deepnvme.optim' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
