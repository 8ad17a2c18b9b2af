"""``deepnvme tune`` run for real at small sizes: pruning, budget, the written config, --plot."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

import deepnvme
from deepnvme import AioHandle
from deepnvme.bench import TuneSpace, run_tune
from deepnvme.io.engine import probe_engines

SMALL = ("--io-size", "1M", "--loops", "1")


def test_tune_writes_a_config_that_aiohandle_consumes(run_cli, leftovers, tmp_path) -> None:
    out_file = tmp_path / "aio.json"
    code, out, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--budget", "30",
                             "--output", str(out_file), "--json")
    assert code == 0, err
    data = json.loads(out)
    available = [p.name for p in probe_engines() if p.available]
    assert data["space_size"] == 200 * len(available)
    assert 1 < len(data["trials"]) < data["space_size"]  # pruned, not the full grid
    # the engine is the first dimension: every engine that runs here is measured
    assert sorted({t["engine"] for t in data["trials"]}) == sorted(available)
    with AioHandle(engine="auto") as h:
        if len(h._engine.movers) > 1:  # auto picks per transfer: the notes say how and why
            note = next(n for n in data["notes"] if "engine auto instead picks" in n)
            assert "file-extending write, 1 worker: io_uring" in note and "synchronous" in note
        assert data["trials"][0]["engine"] == h.engine  # the search starts at auto's pick
    assert set(data["best"]) == {"combined", "read", "write"}
    raw = out_file.read_text()
    assert '"single_submit": false' in raw and '"overlap_events": false' in raw  # JSON booleans
    cfg = json.loads(raw)
    assert set(cfg["aio"]) == {"engine", "block_size", "queue_depth", "intra_op_parallelism",
                               "single_submit", "overlap_events", "use_gds"}
    best = data["best"]["combined"]
    assert cfg["aio"]["engine"] == best["engine"] in available
    with deepnvme.AioHandle.from_config(cfg) as h:
        assert h.engine == best["engine"]
        assert h.get_block_size() == best["block_size"]
        assert h.get_queue_depth() == best["queue_depth"]
        assert h.get_intra_op_parallelism() == best["intra_op_parallelism"]
    assert cfg == data["config"]
    assert leftovers(tmp_path) == []


def test_tune_text_output_says_what_is_not_swept(run_cli, tmp_path) -> None:
    code, out, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--budget", "20",
                             "--output", "-")
    assert code == 0, err
    assert "overlap_events is not swept" in out
    assert "single_submit is not swept: it is written as false" in out
    assert '"single_submit": [false, true]' in out  # rich markup must not eat the brackets
    header = next(line for line in out.splitlines() if "block_size" in line and "#" in line)
    assert "engine" in header
    assert "best combined" in out and "best read" in out and "best write" in out
    assert '"aio"' in out and "not written" in out


def test_tune_budget_stops_the_sweep(tmp_path) -> None:
    space = TuneSpace({"engine": ("threads",), "intra_op_parallelism": (1, 2),
                       "block_size": (256 << 10, 1 << 20), "queue_depth": (8, 32)})
    result = run_tune(str(tmp_path), space=space, io_size=1 << 20, loops=1, budget=1e-6,
                      exhaustive=True)
    assert len(result.trials) == 1 and result.budget_exhausted
    assert any("budget" in n for n in result.notes)
    full = run_tune(str(tmp_path), space=space, io_size=1 << 20, loops=1, budget=60,
                    exhaustive=True, objective="read")
    assert len(full.trials) == 8 and not full.budget_exhausted
    assert {t.engine for t in full.trials} == {"threads"}
    assert full.deepspeed_config()["aio"]["block_size"] == full.best["read"].block_size
    assert full.deepspeed_config()["aio"]["engine"] == "threads"


def test_tune_space_file_and_plot(run_cli, tmp_path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("engine: [threads]\nblock_size: [256K, 1M]\nqueue_depth: [16]\n"
                     "thread_count: [1, 2]\n")
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


def test_tune_ctrl_c_removes_its_temporary_file_and_saves_the_best_so_far(
        spawn, leftovers, tmp_path) -> None:
    import os
    import signal
    import time

    out_file = tmp_path / "aio.json"
    # the exhaustive grid (200+ configurations of 3 x 8M transfers) takes far longer than 2 s
    proc = spawn("tune", "--dir", str(tmp_path), "--io-size", "8M", "--loops", "3",
                 "--budget", "600", "--exhaustive", "--output", str(out_file),
                 start_new_session=True)
    deadline = time.monotonic() + 60
    def working() -> list[str]:  # not the --output check's writability probe, removed at once
        return [n for n in leftovers(tmp_path) if not n.startswith(".deepnvme-probe-")]

    while not working() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert working()
    time.sleep(2.0)  # the warm-up and the first trials are done
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert leftovers(tmp_path) == []
    assert f"deepnvme tune: interrupted; the best so far is written to {out_file}" in err
    assert "interrupted (Ctrl-C) after" in out and "best combined" in out
    with AioHandle.from_config(json.loads(out_file.read_text())) as h:
        assert h.engine in [p.name for p in probe_engines() if p.available]


def test_failed_buffer_allocation_leaves_no_temp_file(tmp_path, monkeypatch):
    """Regression: tune created its temp file before allocating the buffer."""
    from deepnvme.bench import tune as tune_mod

    def no_memory(*args, **kwargs):
        raise MemoryError("simulated")

    monkeypatch.setattr(tune_mod, "new_cpu_locked_tensor", no_memory)
    with pytest.raises(MemoryError):
        tune_mod.run_tune(str(tmp_path), io_size=1 << 20)
    assert list(tmp_path.iterdir()) == []


def _kernel_engine_or_threads() -> str:
    return next((p.name for p in probe_engines() if p.available and p.name != "threads"),
                "threads")


def test_tune_sweeps_single_submit_when_the_space_lists_both(run_cli, tmp_path) -> None:
    engine = _kernel_engine_or_threads()
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"engine": [engine], "single_submit": [True, False],
                                 "block_size": ["256K"], "queue_depth": [8], "thread_count": [1]}))
    out_file = tmp_path / "aio.json"
    code, out, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--space", str(space),
                             "--exhaustive", "--output", str(out_file))
    assert code == 0, err
    header = next(line for line in out.splitlines() if "block_size" in line and "#" in line)
    assert "ss" in header and "engine" in header and "ss = single_submit" in out
    assert "single_submit is not swept" not in out
    code, out, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--space", str(space),
                             "--exhaustive", "--output", str(out_file), "--force", "--json")
    assert code == 0, err  # --force: the first run's file is replaced
    data = json.loads(out)
    assert [(t["engine"], t["single_submit"]) for t in data["trials"]] == [
        (engine, False), (engine, True)]
    best = data["best"]["combined"]
    assert json.loads(out_file.read_text())["aio"]["single_submit"] is best["single_submit"]


def _fake_probes(monkeypatch, unavailable: str) -> None:
    import deepnvme.io.engine as engine_mod

    real = engine_mod.probe_engines()
    fake = tuple(dataclasses.replace(p, available=False, detail="faked: not here")
                 if p.name == unavailable else p for p in real)
    monkeypatch.setattr(engine_mod, "probe_engines", lambda: fake)


def test_tune_drops_engines_that_do_not_run_here(run_cli, monkeypatch, tmp_path) -> None:
    _fake_probes(monkeypatch, "aio")
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"engine": ["aio", "threads"], "block_size": ["256K"],
                                 "queue_depth": [8], "thread_count": [1]}))
    code, out, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--space", str(space),
                             "--output", "-", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["space_size"] == 1 and [t["engine"] for t in data["trials"]] == ["threads"]
    assert "engine aio not swept: not available here (faked: not here)" in data["notes"]
    space.write_text(json.dumps({"engine": ["aio"]}))
    code, out, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--space", str(space))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "none of the engines to sweep runs here (aio: faked" in err


def test_tune_space_rejects_unknown_engines(run_cli, tmp_path) -> None:
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"engine": ["threads", "spdk"]}))
    code, _, err = run_cli("tune", "--dir", str(tmp_path), "--space", str(space))
    assert code == 2 and "engine 'spdk' is not one of" in err and err.count("\n") == 1


def _interrupt_after(monkeypatch, trials: int) -> None:
    """Ctrl-C (a KeyboardInterrupt) when the sweep asks for configuration ``trials + 1``."""
    from deepnvme.bench import tune as tune_mod

    measure = tune_mod._Trials.get

    def get(self, point):
        if point not in self.cache and len(self.cache) == trials:
            raise KeyboardInterrupt
        return measure(self, point)

    monkeypatch.setattr(tune_mod._Trials, "get", get)


def test_tune_ctrl_c_writes_and_prints_the_best_so_far(run_cli, monkeypatch, tmp_path) -> None:
    _interrupt_after(monkeypatch, 3)
    out_file = tmp_path / "aio.json"
    code, out, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--output", str(out_file),
                             "--json")
    assert code == 130
    assert err == f"deepnvme tune: interrupted; the best so far is written to {out_file}\n"
    data = json.loads(out)
    assert data["interrupted"] is True and len(data["trials"]) == 3
    assert any("interrupted (Ctrl-C) after 3 configurations" in n for n in data["notes"])
    best = max(data["trials"], key=lambda t: t["combined_GBps"])
    assert data["best"]["combined"] == best
    assert json.loads(out_file.read_text()) == data["config"]
    assert data["config"]["aio"]["block_size"] == best["block_size"]


def test_tune_ctrl_c_before_any_trial_writes_nothing(run_cli, monkeypatch, leftovers,
                                                     tmp_path) -> None:
    _interrupt_after(monkeypatch, 0)
    out_file = tmp_path / "aio.json"
    code, out, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--output", str(out_file))
    assert code == 130 and out == "" and "interrupted" in err
    assert not out_file.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("option, target, message", [
    ("--output", "{tmp}", "is a directory; give a file name"),
    ("--output", "{tmp}/missing/aio.json", "does not exist"),
    ("--output", "{tmp}/old.json", "already exists; add --force to overwrite it"),
    ("--output", "/proc/aio.json", "cannot create files in '/proc'"),
    ("--plot", "{tmp}", "is a directory; give a file name"),
    ("--plot", "{tmp}/missing/tune.png", "does not exist"),
    ("--plot", "{tmp}/old.json", "already exists; add --force to overwrite it"),
])
def test_tune_checks_its_output_paths_before_sweeping(run_cli, monkeypatch, tmp_path, option,
                                                      target, message) -> None:
    from deepnvme.bench import tune as tune_mod

    def no_sweep(*args, **kwargs):
        raise AssertionError("swept before checking the output paths")

    monkeypatch.setattr(tune_mod, "_sweep", no_sweep)
    (tmp_path / "old.json").write_text("keep me")
    argv = ["tune", "--dir", str(tmp_path), *SMALL, option, target.format(tmp=tmp_path)]
    if option == "--plot":
        argv += ["--output", str(tmp_path / "aio.json")]
    code, out, err = run_cli(*argv)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"deepnvme tune: error: {option} ") and message in err, err
    assert (tmp_path / "old.json").read_text() == "keep me"


def test_tune_force_overwrites_an_existing_output(run_cli, tmp_path) -> None:
    out_file = tmp_path / "aio.json"
    out_file.write_text("old")
    code, _, err = run_cli("tune", "--dir", str(tmp_path), *SMALL, "--budget", "5",
                           "--output", str(out_file), "--force", "--json")
    assert code == 0, err
    with AioHandle.from_config(json.loads(out_file.read_text())):
        pass


def test_tune_unparsable_space_files_are_one_line(run_cli, tmp_path) -> None:
    pytest.importorskip("yaml")
    for name, text in (("bad.yaml", "engine: [threads\n"), ("bad.json", "{")):
        (tmp_path / name).write_text(text)
        code, out, err = run_cli("tune", "--dir", str(tmp_path), "--space", str(tmp_path / name))
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert "not valid " + name.split(".")[1].upper() in err


def test_tune_load_measures_caches_and_report_shows_it(run_cli, leftovers, tmp_path, monkeypatch) -> None:
    from deepnvme.checkpoint import _load_path
    monkeypatch.setenv("DEEPNVME_CACHE_DIR", str(tmp_path / "cache"))
    _load_path.forget()
    code, out, err = run_cli("report", "--dir", str(tmp_path), "--json")
    check = next(c for c in json.loads(out)["checks"] if c["name"] == "load path")
    assert check["status"] == "OK" and "not measured" in check["value"] and "tune --load" in check["value"]
    code, out, err = run_cli("tune", "--load", "--dir", str(tmp_path), "--json", "--load-size", "32M",
                             "--load-rounds", "1")
    assert code == 0, err
    data = json.loads(out)
    assert data["reason"].startswith("whole 0.03 GB loads in fresh processes:"), data["reason"]
    assert data["fresh"] in ("direct", "mapped") and data["into"] in ("direct", "mapped")
    assert set(data["rates"]) == {"fresh_direct", "fresh_mapped", "into_direct", "into_mapped"}
    assert "GB/s" in data["reason"] and data["cache"] == str(tmp_path / "cache" / "load-paths.json")
    assert not [p for p in tmp_path.iterdir() if "load-probe" in p.name]  # the probe file is gone
    _load_path.forget()  # another process: the report reads the cache file
    code, out, err = run_cli("report", "--dir", str(tmp_path), "--json")
    check = next(c for c in json.loads(out)["checks"] if c["name"] == "load path")
    assert check["status"] == "OK" and check["data"]["fresh"] == data["fresh"]
    assert data["reason"] in check["value"]
