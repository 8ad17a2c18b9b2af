"""pytest plugin for DeepSpeed's op tests run against deepnvme: markers and a provenance header."""

from __future__ import annotations

import os
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sequential: DeepSpeed runs these tests one at a time")
    config.addinivalue_line("markers", "nightly: DeepSpeed's nightly tests")


def pytest_report_header(config: pytest.Config) -> list[str]:
    from deepspeed.accelerator import get_accelerator

    import deepnvme
    src = os.environ.get("DEEPNVME_DEEPSPEED_SRC") or "(none: deepspeed.io unavailable)"
    return [f"deepnvme {deepnvme.__version__} from {os.path.dirname(deepnvme.__file__)}",
            f"DeepSpeed sources: {src}",
            f"accelerator: {get_accelerator().device_name()}"]


_ONCE: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[Any]) -> None:
    for item in items:
        size = getattr(getattr(item, "cls", None), "world_size", 1)
        if isinstance(size, int) and size > 1:
            _ONCE.append(f"{item.nodeid} (world_size={size})")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _ONCE:
        terminalreporter.section("deepnvme shim: multi-rank tests run once, as rank 0")
        for line in _ONCE:
            terminalreporter.write_line(line)
