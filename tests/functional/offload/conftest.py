"""The offload tests use tiny models whose parameters are all below the default
``min_offload_bytes``; they test the file path, so every parameter is offloaded here unless a
test module sets ``KEEP_SMALL_DEFAULT = True`` (the resident path has its own tests)."""

import pytest

from deepnvme.offload import parameters


@pytest.fixture(autouse=True)
def offload_every_parameter(request, monkeypatch):
    if not getattr(request.module, "KEEP_SMALL_DEFAULT", False):
        monkeypatch.setattr(parameters, "MIN_OFFLOAD_BYTES", 0)
