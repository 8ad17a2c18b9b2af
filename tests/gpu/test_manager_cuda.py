"""CheckpointManager with CUDA: snapshot saves of CUDA tensors and the CUDA RNG states.

Skipped without CUDA (the CPU suites cannot reach the CUDA branches of capture_rng/restore_rng).
"""

from __future__ import annotations

import os

import pytest
import torch

import deepnvme
from deepnvme.checkpoint.manager import RNG_KEY
from deepnvme.checkpoint.manager._steps import FILE, step_dir

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_tensors_and_cuda_rng_states_round_trip(tmp_path):
    torch.cuda.manual_seed_all(3)
    w = torch.randn(100_000, device="cuda")  # CUDA is initialised: its generators are saved
    with deepnvme.CheckpointManager(tmp_path, staging="snapshot") as mgr:
        assert mgr.save(1, {"w": w, "n": 1})
        want = [torch.randn(8, device=f"cuda:{i}") for i in range(torch.cuda.device_count())]
        w.mul_(2)  # the snapshot holds the value at save()
        mgr.wait()
    reader = deepnvme.CheckpointManager(tmp_path)
    saved = deepnvme.load(os.path.join(step_dir(str(tmp_path), 1), FILE))[RNG_KEY]   # load() omits it
    assert len(saved["cuda"]) == torch.cuda.device_count()
    state = {"w": torch.zeros(100_000, device="cuda"), "n": 0}
    assert reader.restore(state) == 1 and state["n"] == 1
    assert state["w"].device.type == "cuda" and torch.equal(state["w"], w / 2)
    for i, draw in enumerate(want):  # every device's generator is back where it was at save()
        assert torch.equal(torch.randn(8, device=f"cuda:{i}"), draw)
