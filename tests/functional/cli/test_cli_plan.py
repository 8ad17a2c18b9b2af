"""``deepnvme plan --checkpoint PATH``: the checkpoint size read from disk instead of given."""

from __future__ import annotations

import json

import pytest
import torch

import deepnvme
from deepnvme.bench import checkpoint_size

PLAN = ("--write-gbps", "1", "--step-seconds", "1", "--mtbf-hours", "24")


def test_plan_sizes_a_manager_folder_by_its_latest_step(run_cli, run_json, tmp_path) -> None:
    mgr = deepnvme.CheckpointManager(str(tmp_path), keep=2)
    mgr.save(3, {"w": torch.randn(1 << 16)})
    mgr.save(4, {"w": torch.randn(1 << 18)})
    mgr.wait()
    mgr.close()
    data = run_json("plan", "--checkpoint", str(tmp_path), *PLAN)
    size = checkpoint_size(str(tmp_path))
    assert data["checkpoint"]["step"] == 4 and data["checkpoint"]["nbytes"] == size.nbytes > 1 << 20
    assert data["checkpoint_gb"] == pytest.approx(size.nbytes / 1e9)
    assert data["save_seconds"] == pytest.approx(size.nbytes / 1e9)  # at 1 GB/s
    given = run_json("plan", "--checkpoint-gb", str(size.nbytes / 1e9), *PLAN)
    assert given["interval_steps"] == data["interval_steps"] and given["checkpoint"] is None
    code, out, err = run_cli("plan", "--checkpoint", str(tmp_path), *PLAN)
    assert code == 0, err
    assert f"checkpoint size from {size.path} (step 4): {size.nbytes} bytes in" in out
    assert "one save takes" in out


def test_plan_sizes_a_file_and_measures_at_most_its_size(run_json, tmp_path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.randn(1 << 14)}, path)
    data = run_json("plan", "--checkpoint", str(path), "--measure", str(tmp_path),
                    "--step-seconds", "1", "--mtbf-hours", "1")
    assert data["checkpoint"] == {"path": str(path), "nbytes": path.stat().st_size, "files": 1,
                                  "step": None}
    assert data["write_gbps"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # the measurement file is gone


@pytest.mark.parametrize("argv, message", [
    (("--checkpoint", "{tmp}/missing"), "does not exist"),
    (("--checkpoint", "{tmp}"), "holds no data"),
    (("--checkpoint", "{tmp}", "--checkpoint-gb", "1"), "not allowed with argument"),
    ((), "one of the arguments --checkpoint-gb --checkpoint is required"),
])
def test_plan_size_errors_are_one_line(run_cli, tmp_path, argv, message) -> None:
    code, out, err = run_cli("plan", *(a.format(tmp=tmp_path) for a in argv), *PLAN)
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert message in err, err


def test_plan_json_keeps_its_keys(run_json) -> None:
    data = run_json("plan", "--checkpoint-gb", "100", "--write-gbps", "10", "--step-seconds", "2",
                    "--mtbf-hours", "24")
    assert data["interval_steps"] == 657 and json.dumps(data)
