"""``deepnvme tune`` run for real at small sizes: pruning, budget, the written config, --plot."""

from __future__ import annotations

import json
import sys

import pytest


import deepnvme
from deepnvme.cli.tune import TuneSpace, run_tune

SMALL = ("--io-size", "1M", "--loops", "1")


def test_tune_writes_a_config_that_aiohandle_consumes(run_cli, leftovers, tmp_path) -> None:
    out_file = tmp_path / "aio.json"
    code, out, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--budget", "30",
                             "--output", str(out_file), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert 1 < len(data["trials"]) < data["space_size"] == 200  # pruned, not the full grid
    assert set(data["best"]) == {"combined", "read", "write"}
    raw = out_file.read_text()
    assert '"single_submit": false' in raw and '"overlap_events": false' in raw  # JSON booleans
    cfg = json.loads(raw)
    assert set(cfg["aio"]) == {"engine", "block_size", "queue_depth", "intra_op_parallelism",
                               "single_submit", "overlap_events", "use_gds"}
    best = data["best"]["combined"]
    with deepnvme.AioHandle.from_config(cfg) as h:
        assert h.get_block_size() == best["block_size"]
        assert h.get_queue_depth() == best["queue_depth"]
        assert h.get_intra_op_parallelism() == best["intra_op_parallelism"]
    assert cfg == data["config"]
    assert leftovers(tmp_path) == []


def test_tune_text_output_says_what_is_not_swept(run_cli, tmp_path) -> None:
    code, out, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--budget", "20",
                             "--output", "-")
    assert code == 0, err
    assert "single_submit and overlap_events are not swept" in out
    assert "best combined" in out and "best read" in out and "best write" in out
    assert '"aio"' in out and "not written" in out


def test_tune_budget_stops_the_sweep(tmp_path) -> None:
    space = TuneSpace({"intra_op_parallelism": (1, 2), "block_size": (256 << 10, 1 << 20),
                       "queue_depth": (8, 32)})
    result = run_tune(str(tmp_path), space=space, io_size=1 << 20, loops=1, budget=1e-6,
                      exhaustive=True)
    assert len(result.trials) == 1 and result.budget_exhausted
    assert any("budget" in n for n in result.notes)
    full = run_tune(str(tmp_path), space=space, io_size=1 << 20, loops=1, budget=60,
                    exhaustive=True, objective="read")
    assert len(full.trials) == 8 and not full.budget_exhausted
    assert full.deepspeed_config()["aio"]["block_size"] == full.best["read"].block_size


def test_tune_space_file_and_plot(run_cli, tmp_path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("block_size: [256K, 1M]\nqueue_depth: [16]\nthread_count: [1, 2]\n")
    png = tmp_path / "tune.png"
    code, out, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--space", str(space),
                             "--exhaustive", "--output", "-", "--plot", str(png), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["space_size"] == 4 and len(data["trials"]) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tune_plot_without_matplotlib_fails_before_sweeping(run_cli, monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out_file = tmp_path / "aio.json"
    code, _, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--output", str(out_file),
                           "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "pip install 'deepnvme[plot]'" in err
    assert not out_file.exists()


def test_tune_bad_space_and_dir(run_cli, tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_threads": [1, 2]}')
    code, _, err = run_cli("tune", "--dir", str(tmp_path), "--space", str(bad))
    assert code == 2 and "unknown setting 'num_threads'" in err
    code, _, err = run_cli("tune", "--dir", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err


def test_tune_ctrl_c_removes_its_temporary_file(spawn, leftovers, tmp_path) -> None:
    import os
    import signal
    import time

    out_file = tmp_path / "aio.json"
    proc = spawn("tune", "--dir", str(tmp_path), "--io-size", "16M", "--budget", "120",
                 "--exhaustive", "--output", str(out_file), start_new_session=True)
    deadline = time.monotonic() + 60
    while not leftovers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers(tmp_path)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert leftovers(tmp_path) == [] and not out_file.exists()


def test_failed_buffer_allocation_leaves_no_temp_file(tmp_path, monkeypatch):
    """Regression: tune created its temp file before allocating the buffer."""
    from deepnvme.cli import tune as tune_mod

    def no_memory(*args, **kwargs):
        raise MemoryError("simulated")

    monkeypatch.setattr(tune_mod, "new_cpu_locked_tensor", no_memory)
    with pytest.raises(MemoryError):
        tune_mod.run_tune(str(tmp_path), io_size=1 << 20)
    assert list(tmp_path.iterdir()) == []
