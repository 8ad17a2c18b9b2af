"""Helpers for running the real ``deepnvme`` command in-process or as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepnvme.cli.main import main

SRC = str(Path(__file__).resolve().parents[3] / "src")


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".deepnvme-"))


@pytest.fixture
def run_cli(capsys):
    """Call ``main(argv)`` in-process; return (exit code, stdout, stderr)."""
    def run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


@pytest.fixture
def run_json(run_cli):
    def run(*argv: str) -> dict:
        code, out, err = run_cli(*argv, "--json")
        assert code == 0, err
        return json.loads(out)
    return run


def _spawn(*argv: str, module: str = "deepnvme.cli.main", **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", module, *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.fixture
def spawn():
    """Start ``python -m deepnvme.cli.main ARGV`` (or ``module=``) with this checkout's src
    first on the path."""
    return _spawn


@pytest.fixture
def leftovers():
    """Names of deepnvme temporary files left in a directory."""
    return _leftovers
