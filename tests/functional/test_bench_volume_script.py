"""benchmarks/bench_volume.py still runs end to end at toy sizes and leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_volume(tmp_path):
    dirs = [tmp_path / n for n in ("d0", "d1", "raid")]
    for d in dirs:
        d.mkdir()
    out_json = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_volume.py"),
                           "--drives", str(dirs[0]), str(dirs[1]), "--btrfs", str(dirs[2]),
                           "--size", "8M", "--reps", "1", "--json", str(out_json)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "deepnvme volume" in proc.stdout and "volume / deepnvme 1 drive" in proc.stdout
    if shutil.which("fio"):
        assert "fio 2 jobs (sum)" in proc.stdout
    result = json.loads(out_json.read_text())
    assert result["median_s"]["deepnvme volume"]["write"] > 0
    assert all(list(d.iterdir()) == [] for d in dirs)
