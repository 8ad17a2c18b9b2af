"""examples/train_offloaded.py trains a tiny transformer end to end and cleans up after itself."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_training_example_runs_and_the_loss_falls(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_offloaded.py"), "--dir", str(tmp_path),
         "--layers", "2", "--dim", "32", "--heads", "2", "--vocab", "64", "--seq", "8",
         "--batch", "4", "--steps", "6", "--accum", "2"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "step 6/6" in out and "held at most" in out and "peak RSS" in out
    first, last = (float(v) for v in out.split("loss ")[-1].split(";")[0].split(" -> "))
    assert last < first
    # the model is larger than the budget, and what was held stayed within it (+ one gradient)
    params = float(re.search(r"([\d.]+) MiB of parameters", out).group(1))
    held, budget = (float(v) for v in re.search(r"held at most ([\d.]+) MiB of ([\d.]+) MiB",
                                                out).groups())
    assert params > budget and 0 < held <= budget + 0.02, out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("deepnvme-swap")]
