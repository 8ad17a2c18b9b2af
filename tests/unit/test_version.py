"""One version string: ``deepnvme/_version.py``, read by the package and by pyproject.toml."""

from __future__ import annotations

from pathlib import Path

import deepnvme
from deepnvme import _version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_package_version_comes_from_version_module() -> None:
    assert deepnvme.__version__ is _version.__version__
    assert deepnvme.__version__.count(".") == 2


def test_pyproject_reads_the_version_from_the_package() -> None:
    from setuptools.config.pyprojecttoml import read_configuration

    config = read_configuration(PYPROJECT)
    assert "version" in config["project"]["dynamic"]
    assert config["project"]["version"] == deepnvme.__version__
