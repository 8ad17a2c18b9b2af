"""``deepnvme bench`` run for real at small sizes: JSON, --compare, --procs, errors, cleanup."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import statistics
import time

import pytest
import torch

from deepnvme import AioHandle
from deepnvme.bench import BenchOptions, run_bench
from deepnvme.config import ENGINE_NAMES, resolve_config
from deepnvme.io.engine import probe_engines

SMALL = ("--io-size", "1M", "--loops", "2", "--warmup-loops", "1")


def _auto() -> str:
    with AioHandle(engine="auto") as h:
        return h.engine


def _available() -> list[str]:
    return [p.name for p in probe_engines() if p.available]


def _check_stats(d: dict) -> None:
    assert 0 < d["min"] <= d["median"] <= d["max"]


def test_bench_json_default_ops(run_json, leftovers, tmp_path) -> None:
    data = run_json("bench", "--dir", str(tmp_path), *SMALL, "--block-size", "256K",
                    "--queue-depth", "8", "--parallelism", "2")
    assert data["GB"] == "1e9 bytes" and data["io_size"] == 1 << 20 and data["procs"] == 1
    assert data["config"]["block_size"] == 256 << 10 and data["config"]["queue_depth"] == 8
    assert data["config"]["intra_op_parallelism"] == 2
    assert [(r["tool"], r["op"]) for r in data["results"]] == [("deepnvme", "write"),
                                                               ("deepnvme", "read")]
    for r in data["results"]:
        assert len(r["task_seconds"]) == 2 and len(r["e2e_seconds"]) == 2
        for key in ("e2e_GBps", "e2e_latency_s", "task_GBps", "task_latency_s"):
            _check_stats(r[key])
        # GB/s is bytes / seconds / 1e9, and min rate goes with max latency
        assert r["e2e_GBps"]["min"] == pytest.approx((1 << 20) / r["e2e_latency_s"]["max"] / 1e9)
    assert leftovers(tmp_path) == []


def test_bench_read_only_validate_and_ds_io_flags(run_json, leftovers, tmp_path) -> None:
    data = run_json("bench", "--dir", str(tmp_path), *SMALL, "--read", "--validate",
                    "--single-submit", "--sequential-requests", "--engine", "threads")
    assert [r["op"] for r in data["results"]] == ["read"]
    assert data["config"]["single_submit"] is True and data["config"]["overlap_events"] is False
    assert any("ds_io parity" in n for n in data["notes"])
    assert any("--single-submit has no effect with the threads engine" in n
               for n in data["notes"])
    data = run_json("bench", "--dir", str(tmp_path), *SMALL, "--write", "--validate")
    assert [r["op"] for r in data["results"]] == ["write"]
    assert data["config"]["overlap_events"] is True  # ds_io: not --sequential-requests
    assert leftovers(tmp_path) == []


def test_bench_compare_runs_python_and_fio_side_by_side(run_cli, leftovers, tmp_path) -> None:
    code, out, err = run_cli("bench", "--dir", str(tmp_path), *SMALL, "--compare", "--validate",
                             "--json")
    assert code == 0, err
    data = json.loads(out)
    expected = ["deepnvme", "python"] + (["fio"] if shutil.which("fio") else [])
    assert data["tools"] == expected
    assert {(r["tool"], r["op"]) for r in data["results"]} == {
        (t, op) for t in expected for op in ("write", "read")}
    engines = {r["tool"]: r["engine"] for r in data["results"]}
    assert engines["python"] is None and engines.get("fio", "libaio") == "libaio"
    assert engines["deepnvme"] == data["engines"][0] == _auto()
    for tool in expected[1:]:
        for op in ("write", "read"):
            ours = next(r for r in data["results"] if r["tool"] == "deepnvme" and r["op"] == op)
            theirs = next(r for r in data["results"] if r["tool"] == tool and r["op"] == op)
            assert data["speedup"][f"{op}_vs_{tool}"] == pytest.approx(
                ours["e2e_GBps"]["median"] / theirs["e2e_GBps"]["median"])
    code, out, err = run_cli("bench", "--dir", str(tmp_path), *SMALL, "--compare")
    assert code == 0, err
    assert "deepnvme is" in out and "python" in out and "GB = 1e9 bytes" in out
    assert leftovers(tmp_path) == []


def test_bench_compare_skips_fio_for_unaligned_sizes(tmp_path) -> None:
    opts = BenchOptions(dirs=(str(tmp_path),), io_size=100_000, loops=1, warmup=0, compare=True,
                        config=resolve_config({"block_size": 65536}))
    result = run_bench(opts)
    assert result.tools == ("deepnvme", "python")
    assert any("fio" in n for n in result.notes)


def test_bench_procs_two_are_barrier_synchronised(run_json, leftovers, tmp_path) -> None:
    other = tmp_path / "second"
    other.mkdir()
    data = run_json("bench", "--dir", str(tmp_path), "--dir", str(other), "--procs", "2",
                    "--io-size", "1M", "--loops", "2", "--warmup-loops", "0")
    assert data["procs"] == 2
    for r in data["results"]:
        assert len(r["task_seconds"]) == 4 and len(r["e2e_seconds"]) == 2
        # e2e spans both processes of a step: never shorter than the slower task of that step
        assert min(r["e2e_seconds"]) >= min(r["task_seconds"]) * 0.999
        assert r["e2e_GBps"]["median"] > 0
    assert leftovers(tmp_path) == [] and leftovers(other) == []


@pytest.mark.parametrize("argv, message", [
    (("--dir", "/definitely/not/here"), "does not exist"),
    (("--gds",), "GPUDirect Storage is not available"),
    (("--loops", "0"), "argument --loops: must be >= 1, got 0"),
    (("--io-size", "1000T"), "GB free"),
    (("--io-size", "lots"), "argument --io-size: cannot parse size 'lots'"),
    (("--dir", ".", "--dir-map", "/x:0"), "either --dir or --dir-map"),
    (("--engine", "spdk"), "--engine: unknown engine 'spdk'; choose from: auto, io_uring"),
    (("--engine", ","), "--engine is empty"),
    (("--random", "--random-size", "1000"), "--random-size must be a multiple of 4K from 4K"),
    (("--random", "--random-size", "128K"), "--random-size must be a multiple of 4K from 4K"),
    (("--random", "--random-size", "0"), "argument --random-size: must be at least 1 byte"),
    (("--random-size", "8K"), "--random-size applies to random reads: add --random"),
    (("--random", "--write"), "--random measures reads only: drop --write"),
    (("--random", "--io-size", "10K"), "must be a multiple of --random-size (4096)"),
    (("--random", "--gpu"), "--random reads into CPU buffers"),
])
def test_bench_errors_are_clear(run_cli, argv, message, leftovers, tmp_path) -> None:
    code, out, err = run_cli("bench", *argv)
    assert code == 2 and message in err
    assert out == "" and err.count("\n") == 1  # one line, no traceback
    assert leftovers(tmp_path) == []


def test_bench_gpu_needs_cuda(run_cli, leftovers, tmp_path) -> None:
    code, out, err = run_cli("bench", "--gpu", "--dir", str(tmp_path), *SMALL, "--json")
    if torch.cuda.is_available():
        assert code == 0 and json.loads(out)["gpu"] is True
    else:
        assert code == 2 and "--gpu needs a CUDA device" in err
    assert leftovers(tmp_path) == []


def test_bench_readonly_dir_is_a_clear_error(run_cli, tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    target = "/sys" if os.geteuid() == 0 else str(ro)  # root ignores permission bits
    code, _, err = run_cli("bench", "--dir", target, *SMALL)
    assert code == 2 and "cannot create a file in" in err and "--dir" in err


@pytest.mark.parametrize("procs", ["1", "2"])
def test_ctrl_c_removes_temporary_files(spawn, leftovers, tmp_path, procs) -> None:
    proc = spawn("bench", "--dir", str(tmp_path), "--io-size", "16M", "--loops", "1000",
                 "--procs", procs, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(leftovers(tmp_path)) < int(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(leftovers(tmp_path)) == int(procs)
    time.sleep(1.0)  # inside the timed loops
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert leftovers(tmp_path) == []


def test_bench_dir_map_without_gpu_uses_the_dirs(run_json, leftovers, tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    data = run_json("bench", "--dir-map", f"{a}:0,{b}:1", "--procs", "1", *SMALL, "--write")
    assert data["dirs"] == [str(a), str(b)] and data["gpu"] is False
    assert any("ignored without --gpu" in n for n in data["notes"])
    assert leftovers(a) == [] and leftovers(b) == []


def test_bench_sweeps_every_engine_one_row_each(run_cli, leftovers, tmp_path) -> None:
    available = _available()
    code, out, err = run_cli("bench", "--dir", str(tmp_path), *SMALL, "--validate",
                             "--engine", ",".join(available), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["engines"] == available and data["tools"] == ["deepnvme"]
    assert [(r["op"], r["engine"]) for r in data["results"]] == [
        (op, e) for op in ("write", "read") for e in available]
    for r in data["results"]:
        assert r["tool"] == "deepnvme" and len(r["task_seconds"]) == 2
        _check_stats(r["e2e_GBps"])
    for e in available[1:]:  # ratios against the first engine, per op
        for op in ("write", "read"):
            ours = next(r for r in data["results"] if r["engine"] == available[0] and r["op"] == op)
            theirs = next(r for r in data["results"] if r["engine"] == e and r["op"] == op)
            assert data["speedup"][f"{op}_vs_deepnvme-{e}"] == pytest.approx(
                ours["e2e_GBps"]["median"] / theirs["e2e_GBps"]["median"])
    code, out, err = run_cli("bench", "--dir", str(tmp_path), *SMALL, "--engine",
                             ",".join(available))
    assert code == 0, err
    header = next(line for line in out.splitlines() if "GB/s" in line and "tool" in line)
    assert "engine" in header
    rows = [line for line in out.splitlines() if "deepnvme" in line and "│" in line]
    assert [next(e for e in ENGINE_NAMES if f" {e} " in row) for row in rows] == available * 2
    assert f"deepnvme: engine {', '.join(available)}," in out
    assert leftovers(tmp_path) == []


def test_bench_engine_auto_resolves_and_duplicates_collapse(run_json, tmp_path) -> None:
    auto = _auto()
    data = run_json("bench", "--dir", str(tmp_path), *SMALL, "--write", "--engine",
                    f"auto,{auto},threads")
    assert data["engines"] == list(dict.fromkeys([auto, "threads"]))
    assert [r["engine"] for r in data["results"]] == data["engines"]
    data = run_json("bench", "--dir", str(tmp_path), *SMALL, "--write")  # default: auto
    assert data["engines"] == [auto] and data["results"][0]["engine"] == auto


def test_bench_engine_env_sets_the_default(run_json, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DEEPNVME_ENGINE", "threads")
    data = run_json("bench", "--dir", str(tmp_path), *SMALL, "--write")
    assert data["engines"] == ["threads"] and data["config"]["engine"] == "threads"


def test_bench_refuses_an_engine_that_does_not_run_here(run_cli, monkeypatch, leftovers,
                                                        tmp_path) -> None:
    import deepnvme.io.engine as engine_mod

    fake = tuple(dataclasses.replace(p, available=False, detail="faked: refused")
                 if p.name == "aio" else p for p in probe_engines())
    monkeypatch.setattr(engine_mod, "probe_engines", lambda: fake)
    code, out, err = run_cli("bench", "--dir", str(tmp_path), *SMALL, "--engine", "threads,aio")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "engine 'aio' is not available here: faked: refused" in err
    assert leftovers(tmp_path) == []


RANDOM = ("--random", "--io-size", "256K", "--loops", "2", "--warmup-loops", "1",
          "--queue-depth", "8")


def test_bench_random_reads_json(run_json, leftovers, tmp_path) -> None:
    data = run_json("bench", "--dir", str(tmp_path), *RANDOM, "--random-size", "8K",
                    "--validate")
    assert data["random_size"] == 8192 and data["o_direct"] is True
    (r,) = data["results"]
    assert (r["tool"], r["op"], r["engine"]) == ("deepnvme", "randread", _auto())
    assert r["reads"] == 32 and r["random_size"] == 8192
    for key in ("IOPS", "MBps", "read_latency_s", "e2e_latency_s"):
        _check_stats(r[key])
    for seconds, latency in zip(r["e2e_seconds"], r["read_latency_seconds"]):
        # Little's law with 8 reads in flight (one worker): latency = seconds x 8 / 32 reads
        assert latency == pytest.approx(seconds * 8 / 32, rel=1e-6)
    assert r["IOPS"]["median"] == pytest.approx(r["MBps"]["median"] * 1e6 / 8192)
    assert any("Little" in n or "in flight" in n for n in data["notes"])
    assert leftovers(tmp_path) == []


def test_bench_random_default_size_engines_and_procs(run_json, leftovers, tmp_path) -> None:
    available = _available()
    data = run_json("bench", "--dir", str(tmp_path), *RANDOM, "--engine", ",".join(available),
                    "--procs", "2")
    assert data["random_size"] == 4096 and data["procs"] == 2
    assert [(r["op"], r["engine"]) for r in data["results"]] == [("randread", e) for e in available]
    for r in data["results"]:
        assert r["reads"] == 64 and len(r["read_latency_seconds"]) == 4  # 2 procs x 2 loops
        assert r["IOPS"]["median"] == pytest.approx(
            statistics.median(2 * 64 / s for s in r["e2e_seconds"]))
    assert leftovers(tmp_path) == []


def test_bench_random_compare_runs_fio_randread(run_cli, leftovers, tmp_path) -> None:
    code, out, err = run_cli("bench", "--dir", str(tmp_path), *RANDOM, "--compare", "--json")
    assert code == 0, err
    data = json.loads(out)
    if shutil.which("fio") is None:
        assert data["tools"] == ["deepnvme"] and any("fio" in n for n in data["notes"])
        return
    assert data["tools"] == ["deepnvme", "fio"]  # no plain Python for random reads
    fio = next(r for r in data["results"] if r["tool"] == "fio")
    assert (fio["op"], fio["engine"], fio["reads"]) == ("randread", "libaio", 64)
    assert 0 < fio["read_latency_s"]["median"] < 10 and fio["IOPS"]["median"] > 0
    assert data["speedup"]["randread_vs_fio"] > 0
    code, out, err = run_cli("bench", "--dir", str(tmp_path), *RANDOM, "--compare")
    assert code == 0, err
    for text in ("random reads of 4 KiB", "IOPS", "latency us", "libaio", "deepnvme is"):
        assert text in out, text
    assert leftovers(tmp_path) == []


def test_bench_random_validate_catches_a_read_that_moved_nothing(run_cli, monkeypatch,
                                                                 leftovers, tmp_path) -> None:
    from concurrent.futures import Future

    def lazy_read_many(self, path, items):  # reports every byte, reads none
        fut: Future[int] = Future()
        fut.set_result(sum(t.numel() for t, _ in items))
        return fut

    monkeypatch.setattr(AioHandle, "read_many", lazy_read_many)
    code, out, err = run_cli("bench", "--dir", str(tmp_path), *RANDOM)  # no --validate: runs
    assert code == 0, err
    code, out, err = run_cli("bench", "--dir", str(tmp_path), *RANDOM, "--validate")
    assert code == 2 and "validation failed" in err
    assert leftovers(tmp_path) == []


def test_validate_says_what_it_compared(run_cli, run_json, tmp_path) -> None:
    code, out, err = run_cli("bench", "--dir", str(tmp_path), *SMALL, "--procs", "2",
                             "--validate")
    assert code == 0, err
    # 2 timed + 1 warm-up loop, one write and one read each, in each of 2 processes
    assert ("validated: 6 writes and 6 reads of 1 MiB compared byte-for-byte against the "
            "written data") in out
    assert run_json("bench", "--dir", str(tmp_path), *SMALL, "--validate")["validated"] == {
        "writes": 3, "reads": 3}
    code, out, err = run_cli("bench", "--dir", str(tmp_path), *SMALL)
    assert code == 0 and "validated" not in out, err
    assert run_json("bench", "--dir", str(tmp_path), *SMALL)["validated"] is None


def test_validate_line_for_random_reads(run_cli, tmp_path) -> None:
    code, out, err = run_cli("bench", "--dir", str(tmp_path), "--io-size", "64K", "--loops", "2",
                             "--warmup-loops", "0", "--random", "--random-size", "8K",
                             "--validate")
    assert code == 0, err
    assert ("validated: 2 random-read passes (every 8 KiB block) of 64 KiB compared "
            "byte-for-byte") in out
