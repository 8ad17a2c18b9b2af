"""CheckpointManager across gloo ranks: cached save plans, shared restore reads, checksums while
writing, fenced staging, DTensor meshes, resharding W=4 -> 2 -> 1, and a job killed at each phase."""

from __future__ import annotations

import pytest
import torch

from . import _workers_core
from ._ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")


def test_steady_saves_reuse_the_plan_and_restore_reads_each_item_once(tmp_path):
    run_ranks(_workers_core.steady, 2, str(tmp_path), str(tmp_path / "ck"))
