"""benchmarks/gpu/bench_offload_cuda.py imports, parses its arguments and refuses clearly
without CUDA (it runs on a GPU machine; tests/gpu/test_offload_cuda.py checks the path)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "bench_offload_cuda.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_offload_cuda", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_exits_with_a_message_without_cuda(tmp_path, capsys):
    bench = load()
    out = tmp_path / "r.json"
    assert bench.main(["--out", str(out), "--layers", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):
        bench.main(["--layers", "1"])          # --out is required


def test_the_model_runs_and_counts_its_parameters():
    bench = load()
    model = bench.GPT(vocab=64, dim=32, layers=2, heads=4, seq=16)
    logits = model(torch.randint(0, 64, (2, 16)))
    assert logits.shape == (2, 16, 64)
    per_block = 2 * 2 * 32 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)
    assert sum(p.numel() for p in model.parameters()) == 64 * 32 + 16 * 32 + 2 * per_block + 64 + 64 * 32
