"""Every benchmark script still runs end to end at toy sizes (so BENCHMARKS.md commands never rot)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_bench_engine(tmp_path):
    out = run("bench_engine.py", "--dir", str(tmp_path), "--size", "8M", "--reps", "1", cwd=tmp_path)
    assert "deepnvme p1" in out and "plain Python" in out
    assert list(tmp_path.iterdir()) == []


def test_bench_engines(tmp_path):
    # deepnvme's thread engine, fio when installed; the base python has no DeepSpeed, so its
    # column must be skipped with a note (or, where it has one, measured)
    out = run("bench_engines.py", "--dir", str(tmp_path), "--size", "8M", "--reps", "1",
              "--parallelism", "1,2", "--engines", "threads", "--rand-ios", "256",
              "--ds-python", sys.executable, cwd=tmp_path)
    assert "deepnvme threads p2" in out and "random reads" in out and "CPU s/GB" in out
    assert "DeepSpeed column skipped" in out or "DeepSpeed aio p1" in out
    if shutil.which("fio"):
        assert "fio libaio 1 job" in out and "threads p1 / fio" in out
    assert list(tmp_path.iterdir()) == []


def test_bench_engines_with_a_reused_buffer(tmp_path):
    out = run("bench_engines.py", "--dir", str(tmp_path), "--size", "4M", "--reps", "1",
              "--parallelism", "1", "--engines", "auto", "--no-randread", "--no-fio", "--reuse", "2",
              "--json", str(tmp_path / "r.json"), cwd=tmp_path)
    assert "buffer reused: 2 timed transfers per process" in out and "deepnvme auto p1" in out
    samples = json.loads((tmp_path / "r.json").read_text())["samples"]["deepnvme auto p1"]
    assert {op: [s["bytes"] for s in v] for op, v in samples.items()} == {
        "write_new": [8 << 20], "write": [8 << 20], "read": [8 << 20]}
    (tmp_path / "r.json").unlink()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DEEPNVME_BENCH_DS_PYTHON"),
                    reason="set DEEPNVME_BENCH_DS_PYTHON to a python with DeepSpeed "
                           "(benchmarks/setup_peers.sh)")
def test_bench_engines_with_deepspeed(tmp_path):
    out = run("bench_engines.py", "--dir", str(tmp_path), "--size", "8M", "--reps", "1",
              "--parallelism", "2", "--engines", "threads", "--rand-ios", "256", "--no-fio",
              "--ds-python", os.environ["DEEPNVME_BENCH_DS_PYTHON"], cwd=tmp_path)
    assert "DeepSpeed aio p2" in out and "threads p2 / DeepSpeed p2" in out
    assert "threads / DeepSpeed" in out
    assert list(tmp_path.iterdir()) == []


def test_bench_dispatch(tmp_path):
    out = run("bench_dispatch.py", "--reps", "1", cwd=tmp_path)
    assert "chunks/s, 4 workers" in out and "requests/s" in out
    assert list(tmp_path.iterdir()) == []


def test_offload_bench(tmp_path):
    out = run("offload_bench.py", "--dir", str(tmp_path / "d"), "--params", "300000", "--steps", "1",
              "--reps", "1", "--sub-group-bytes", "262144", cwd=tmp_path)
    assert "NVMeOptimizer" in out and "roofline" in out


@pytest.mark.slow
def test_inference_stream(tmp_path):
    out = run("inference_stream.py", "--dir", str(tmp_path), "--hidden", "64", "--intermediate", "128",
              "--layers", "2", "--heads", "2", "--vocab", "128", "--batch", "1", "--prompt-len", "4",
              "--gen-len", "2", "--rounds", "1", "--prefetch", "1", "--modes", "memory,deepnvme",
              "--bandwidth-size", "8M", "--parallelism", "2", "--block-size", "1M", cwd=tmp_path)
    assert "deepnvme" in out and "memory" in out


@pytest.mark.slow
def test_bench_stream_quant(tmp_path):
    out = run("bench_stream_quant.py", "--dir", str(tmp_path), "--hidden", "128", "--intermediate", "256",
              "--layers", "2", "--heads", "2", "--vocab", "128", "--group-size", "64", "--acc-tokens", "4",
              "--gen-len", "2", "--rounds", "1", "--parallelism", "1", "--block-size", str(1 << 20),
              "--bandwidth-size", str(8 << 20), "--out", str(tmp_path / "r.json"), cwd=tmp_path)
    assert "accuracy int4" in out and "vs bf16" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data["throughput"]) == {"bf16", "int8", "int4"} and set(data["accuracy"]) == {"int8", "int4"}
    sizes = {m: r["packed_gb"] for m, r in data["throughput"].items()}
    assert sizes["int4"] < sizes["int8"] < sizes["bf16"]


@pytest.mark.slow
def test_bench_checkpoint(tmp_path):
    out = run("bench_checkpoint.py", "--dir", str(tmp_path), "--layers", "1", "--reps", "1",
              "--pair-rounds", "1", cwd=tmp_path)
    assert "deepnvme.save vs torch.save" in out and "async_save" in out
    assert "recycle=True" in out and "alone, 1 rounds" in out
    assert list(tmp_path.iterdir()) == []


def test_bench_save_parts(tmp_path):
    out = run("bench_save_parts.py", "--dir", str(tmp_path), "--size", "16M", "--reps", "1",
              cwd=tmp_path)
    assert "copy_bytes, 1 thread" in out and "deepnvme commit" in out and "new torch.empty" in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.access("/proc/sys/vm/drop_caches", os.W_OK), reason="needs root (drop_caches)")
def test_bench_load(tmp_path):
    out = run("bench_load.py", "--dir", str(tmp_path), "--tiny", "--layers", "1", "--reps", "1",
              "--cases", "st,pt_dir,into_st,into_st_dir,into_pt_dir", "--readers", "deepnvme,safetensors,torch_mmap",
              cwd=tmp_path)
    assert "| st | deepnvme |" in out and "| pt_dir | torch_mmap |" in out and "| into_st | safetensors |" in out
    assert "| into_st_dir | deepnvme |" in out and "| into_st_dir | safetensors |" in out
    assert "| into_pt_dir | deepnvme |" in out and "| into_pt_dir | torch_mmap |" in out


def test_bench_fresh_memory(tmp_path):
    out = run("bench_fresh_memory.py", "--size", "16M", "--reps", "1", cwd=tmp_path)
    assert "MAP_POPULATE" in out and "touch every 4 KiB page" in out


def test_bench_data(tmp_path):
    corpus = tmp_path / "corpus"
    out = run("bench_data.py", "--dir", str(corpus), "--size", "300K", "--seq-len", "64", "--shuffled", "50",
              "--sequential", "100", "--reps", "1", "--evict", "fadvise", "--json", str(tmp_path / "r.json"),
              cwd=tmp_path)
    assert "shuffled: deepnvme / np.memmap" in out and "sequential: deepnvme / np.memmap" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["made_corpus"] and {r["order"] for r in data["rows"]} == {"shuffled", "sequential"}
    assert list(corpus.iterdir()) == []


def test_bench_manager(tmp_path):
    out = run("bench_manager.py", "--dir", str(tmp_path), "--state-gb", "0.004", "--steps", "1",
              "--warmup", "1", "--reps", "1", "--batch", "4", "--restore-reps", "1",
              "--json", str(tmp_path / "out.json"), cwd=tmp_path)
    for name in ("none", "fenced", "snapshot", "dcp_async", "torch_thread", "restore (cold)",
                 "snapshot_blocked_over_copy", "restore_speedup_vs_stock"):
        assert name in out
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_bench_manager_ranks(tmp_path):
    out = run("bench_manager_ranks.py", "--dir", str(tmp_path / "ck"), "--state-mb", "1", "--width", "64",
              "--batch", "4", "--steps", "1", "--warmup", "0", "--reps", "1", "--no-drop-caches",
              "--dcp-checkpointer", "thread", "--savers", "none,copy,deepnvme,dcp_async",
              "--json", str(tmp_path / "out.json"), cwd=tmp_path)
    for name in ("none", "deepnvme", "dcp_async", "restore (cold)", "restore_speedup_vs_dcp_load",
                 "target added_vs_dcp <= 0.5", "snapshot_blocked_over_copy_in_loop"):
        assert name in out
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["configs"]["deepnvme"]["bytes_per_rank"][1] > 0  # both ranks wrote their share
    assert data["ratios"]["share_copy_s"] > 0 and data["ratios"]["snapshot_blocked_over_share_copy"] > 0
    assert data["configs"]["copy"]["blocked_s"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_bench_manager_reshard(tmp_path):
    out = run("bench_manager_reshard.py", "--dir", str(tmp_path / "ck"), "--world", "2", "--to", "1",
              "--state-mb", "2", "--width", "64", "--reps", "1", "--no-drop-caches",
              "--json", str(tmp_path / "out.json"), cwd=tmp_path)
    assert "restore 2 -> 1 ranks" in out
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["bytes"]["deepnvme"] > 0 and data["bytes"]["dcp"] > 0 and data["speedup_vs_dcp_load"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_bench_manager_volume(tmp_path):
    drives = [tmp_path / "d0", tmp_path / "d1"]
    for d in drives:
        d.mkdir()
    out = run("bench_manager.py", "--dir", str(drives[0]), "--volume", ",".join(map(str, drives)), "--state-gb",
              "0.004", "--steps", "1", "--warmup", "1", "--reps", "2", "--batch", "4", "--timed-saves", "2",
              "--json", str(tmp_path / "out.json"), cwd=tmp_path)
    assert "volume vs one drive" in out and "load average at end" in out
    data = json.loads((tmp_path / "out.json").read_text())
    drives_used = data["volume"]["drives_of_timed_saves"]  # per repetition, successive saves alternate drives
    assert sorted(drives_used[:2]) == sorted(drives_used[2:]) == [0, 1]
    assert min(data["volume"]["bytes_per_drive_kept"]) > 0 and data["loadavg_start"]
    assert [list(d.iterdir()) for d in drives] == [[], []]


def test_bench_manager_ranks_volume(tmp_path):
    drives = [tmp_path / "d0", tmp_path / "d1"]
    for d in drives:
        d.mkdir()
    out = run("bench_manager_ranks.py", "--dir", str(drives[0] / "one"), "--volume", ",".join(map(str, drives)),
              "--state-mb", "1", "--width", "64", "--batch", "4", "--steps", "1", "--warmup", "0", "--reps", "1",
              "--timed-saves", "1", "--no-drop-caches", "--json", str(tmp_path / "out.json"), cwd=tmp_path)
    assert "deepnvme_volume: save until committed" in out
    data = json.loads((tmp_path / "out.json").read_text())
    assert all(b > 0 for b in data["configs"]["deepnvme_volume"]["bytes_per_drive"])  # files on both drives
    assert len(data["configs"]["deepnvme"]["bytes_per_drive"]) == 1 and data["loadavg_end"]
    assert [list(d.iterdir()) for d in drives] == [[], []]


def test_bench_offload_params(tmp_path):
    out = run("bench_offload_params.py", "--dir", str(tmp_path), "--layers", "3", "--dim", "256",
              "--batch", "4", "--budget-mib", "0.75", "--steps", "1", "--reps", "1", cwd=tmp_path)
    assert "step time, offloaded" in out and "<= 1.3 x roof" in out and "peak RSS above baseline" in out
    assert list(tmp_path.iterdir()) == []


def test_bench_offload_gpt(tmp_path):
    # a tiny GPT at a quarter budget: the offloaded mode reports what it read and wrote per step
    js = tmp_path / "gpt.json"
    out = run("bench_offload_gpt.py", "--dir", str(tmp_path / "d"), "--vocab", "1024", "--dim", "128",
              "--layers", "4", "--heads", "4", "--seq", "8", "--steps", "1", "--reps", "1", "--threads", "1",
              "--modes", "memory,defaults", "--json", str(js), cwd=tmp_path)
    assert "read MB" in out and "written MB" in out
    summary = json.loads(js.read_text())["summary"]
    assert summary["memory"]["written_mb"] == 0 and summary["defaults"]["written_mb"] >= 0
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout
    if "tmpfs" not in fs:  # tmpfs writes never reach a block device (/proc/self/io counts 0)
        assert summary["defaults"]["written_mb"] > 0 and summary["defaults"]["read_mb"] > 0
    assert not (tmp_path / "d" / "defaults").exists()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DEEPNVME_BENCH_DS_PYTHON"),
                    reason="set DEEPNVME_BENCH_DS_PYTHON to a python with DeepSpeed "
                           "(benchmarks/setup_peers.sh)")
def test_bench_offload_gpt_deepspeed_swaps(tmp_path):
    # DeepSpeed's peer really swaps: parameter and optimizer swap files, bytes written per step
    js = tmp_path / "gpt.json"
    run("bench_offload_gpt.py", "--dir", str(tmp_path / "d"), "--vocab", "2048", "--dim", "512",
        "--layers", "1", "--heads", "4", "--seq", "8", "--steps", "1", "--reps", "1", "--threads", "1",
        "--modes", "", "--ds-python", os.environ["DEEPNVME_BENCH_DS_PYTHON"], "--json", str(js), cwd=tmp_path)
    row = json.loads(js.read_text())["summary"]["deepspeed"]
    folders = row["swap_files_mb"]
    assert any("params" in k for k in folders) and any("optimizer" in k for k in folders)
    assert row["written_mb"] > 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed here (tools/test_vllm.sh builds its side environment)")
def test_bench_vllm_load(tmp_path):
    out = run("bench_vllm_load.py", "--dir", str(tmp_path), "--layers", "1", "--hidden", "128",
              "--intermediate", "256", "--vocab", "256", "--shard-size", "100KB", "--reps", "1",
              "--formats", "deepnvme,safetensors", "--json", str(tmp_path / "r.json"), cwd=tmp_path)
    assert "deepnvme vs faster peer (safetensors)" in out and "peak RSS" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["shards"] >= 2 and set(data["median"]) == {"deepnvme", "safetensors"}
    assert data["median"]["deepnvme"]["logged_load_s"] is not None   # deepnvme's own log line
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed here (tools/test_vllm.sh builds its side environment)")
def test_bench_vllm_stream(tmp_path):
    out = run("bench_vllm_stream.py", "--dir", str(tmp_path), "--layers", "2", "--hidden", "128",
              "--intermediate", "256", "--vocab", "256", "--budget", "200K", "--reps", "1",
              "--steps", "2", "--batch", "2", "--modes", "deepnvme_stream,memory,footprint",
              "--json", str(tmp_path / "r.json"), cwd=tmp_path)
    assert "I/O roofline" in out and "vLLM footprint" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data["median"]) == {"deepnvme_stream", "memory", "footprint"}
    assert data["ratios"]["tokens_equal_memory"] is True and data["ratios"]["weights_over_budget"] > 2
    assert data["prep"]["streamed_layers"] >= 1 and data["prep"]["bytes_read"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
