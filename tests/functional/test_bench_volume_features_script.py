"""benchmarks/bench_volume_features.py still runs end to end at toy sizes and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_volume_features(tmp_path):
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    out_json = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_volume_features.py"),
                           "--drives", str(dirs[0]), str(dirs[1]), "--size", "8M", "--params", "1M",
                           "--sub-group", "256K", "--tokens", "8M", "--samples", "300",
                           "--seq-len", "256", "--reps", "1", "--json", str(out_json)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "sharded safetensors load" in proc.stdout and "I/O part" in proc.stdout and "token samples" in proc.stdout
    result = json.loads(out_json.read_text())
    assert set(result["ratios_one_drive_over_volume"]) >= {
        "sharded safetensors save", "sharded safetensors load", "dcp save", "dcp load",
        "optimizer step", "optimizer step, I/O part", "token samples"}
    assert all(list(d.iterdir()) == [] for d in dirs)
