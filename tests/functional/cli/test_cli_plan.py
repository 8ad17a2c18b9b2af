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


SIZE_7B = ("--params", "7B", "--dtype", "bf16", "--zero-stage", "3", "--offload", "optimizer,params",
           "--ranks", "1", "--step-seconds", "10", "--drive-gbps", "5", "--checkpoint-every", "100")


def test_plan_params_sizes_storage_and_says_where_numbers_come_from(run_cli, run_json) -> None:
    code, out, err = run_cli("plan", *SIZE_7B)
    assert code == 0, err
    for line in ("model: 7,000,000,000 parameters, bf16, ZeRO stage 3, 1 rank(s); on NVMe: optimizer, params",
                 "NVMe capacity: 518.0 GB", "read 140.0 GB, write 126.0 GB", "at 10 s per step: 26.60 GB/s",
                 "checkpoint: 98.0 GB = 7,000,000,000 x (2 B parameters + 12 B optimizer state)",
                 "drives of 5.00 GB/s: 6 for bandwidth (26.70 GB/s) -> 6", "pinned host memory"):
        assert line in out, line
    data = run_json("plan", *SIZE_7B, "--drive-tb", "0.2", "--mtbf-hours", "24")
    assert data["capacity_bytes"] == 518 * 10**9 and data["drives_for_capacity"] == 3
    assert data["drives"] == 6 and data["explain"][0] == "NVMe capacity: 518.0 GB"
    assert data["interval"]["write_gbps"] == pytest.approx(30.0)  # 6 drives x 5 GB/s
    assert data["interval"]["checkpoint_gb"] == pytest.approx(98.0)


def test_plan_params_defaults_and_measured_drive(run_json, tmp_path) -> None:
    data = run_json("plan", "--params", "1M", "--measure", str(tmp_path))
    assert (data["dtype"], data["zero_stage"], data["ranks"], data["keep"]) == ("bf16", 3, 1, 3)
    assert data["offload_optimizer"] is True and data["offload_params"] is False
    assert data["drive_gbps"] > 0 and data["checkpoint_seconds"] > 0 and data["interval"] is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (("--params", "7X"), "--params: expected a parameter count"),
    (("--params", "7B", "--offload", "gradients"), "--offload takes optimizer, params"),
    (("--params", "7B", "--write-gbps", "3"), "--write-gbps does not go with --params"),
    (("--checkpoint-gb", "1", "--write-gbps", "1", "--step-seconds", "1", "--mtbf-hours", "1",
      "--ranks", "2"), "--ranks goes with --params"),
    (("--checkpoint-gb", "1", "--step-seconds", "1", "--mtbf-hours", "1"),
     "one of the arguments --write-gbps --measure is required"),
    (("--checkpoint-gb", "1", "--write-gbps", "1", "--mtbf-hours", "1"),
     "the following arguments are required: --step-seconds"),
])
def test_plan_mode_errors_are_one_line(run_cli, argv, message) -> None:
    code, out, err = run_cli("plan", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert message in err, err
