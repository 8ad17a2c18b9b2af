"""``deepnvme bench load --device cuda``: every reader's result copied to the GPU, timed."""

from __future__ import annotations

import pytest
import torch

import deepnvme
from deepnvme.bench import LoadOptions, run_load_bench

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bench_load_to_cuda(tmp_path) -> None:
    path = str(tmp_path / "model.safetensors")
    deepnvme.save_safetensors({"w": torch.randn(512, 512), "b": torch.randn(7)}, path)
    result = run_load_bench(LoadOptions(path, reps=2, device="cuda", evict="fadvise"))
    assert result.device == "cuda" and result.to_dict()["device"] == "cuda"
    assert {row.tensors for row in result.rows} == {2} and result.rows[0].reader == "deepnvme"
    assert all(run.seconds > 0 for row in result.rows for run in row.runs)
