"""Pure parts of deepnvme.bench: search, engine lists, fio JSON, /proc and /sys parsing, tune spaces."""

from __future__ import annotations

import json

import pytest
import torch

from deepnvme.bench import BenchResult, OpStats, Trial, default_space, load_space
from deepnvme.bench._engines import EngineStatus, in_flight, parse_engines, require_engines
from deepnvme.bench._measure import RandomReads, fio_command, parse_fio_json, parse_fio_latency
from deepnvme.bench._runner import lanes, plan_steps
from deepnvme.bench._search import closest, coordinate_search, grid
from deepnvme.bench._system import block_device, mount_of
from deepnvme.bench._tune_space import DIMENSIONS, TuneSpace, complete, runnable, start_point
from deepnvme.bench._units import Stats, fmt_size
from deepnvme.bench.report import _engine_checks
from deepnvme.config import ENGINE_NAMES, IOConfig
from deepnvme.errors import ConfigError, DeepNVMeError


def test_coordinate_search_finds_the_peak_with_few_evaluations() -> None:
    dims = {"p": (1, 2, 4, 8, 16), "b": tuple(1 << s for s in range(17, 25)), "q": (8, 32, 128)}
    seen: list[tuple] = []

    def score(point):  # a smooth hill peaking at p=4, b=4 MiB, q=32
        seen.append(point)
        d = dict(point)
        return 10 - abs(d["p"] - 4) - abs((d["b"] >> 20) - 4) / 2 - abs(d["q"] - 32) / 64

    best = coordinate_search(dims, {"p": 1, "b": 1 << 20, "q": 128}, score)
    assert dict(best) == {"p": 4, "b": 4 << 20, "q": 32}
    assert len(set(seen)) < len(grid(dims)) / 5


def test_coordinate_search_stops_when_score_returns_none() -> None:
    calls = []

    def score(point):
        calls.append(point)
        return None if len(calls) > 2 else float(dict(point)["x"])

    best = coordinate_search({"x": (1, 2, 3, 4)}, {"x": 1}, score)
    assert dict(best) == {"x": 2} and len(calls) == 3


def test_coordinate_search_ignores_gains_within_tolerance() -> None:
    best = coordinate_search({"x": (1, 2)}, {"x": 1}, lambda p: 1.0 + 0.01 * dict(p)["x"])
    assert dict(best) == {"x": 1}


def test_closest_and_grid() -> None:
    assert closest((128 << 10, 1 << 20, 4 << 20), 1 << 20) == 1 << 20
    assert closest((8, 16, 64), 128) == 64
    assert len(grid({"a": (1, 2), "b": (3, 4, 5)})) == 6


def test_plan_steps_interleaves_tools_and_writes_deepnvme_last() -> None:
    steps = plan_steps(tools=("deepnvme", "python", "fio"), engines=("aio",), write=True,
                       read=True, loops=1, warmup=1)
    assert [s.loop for s in steps] == [-1] * 6 + [0] * 6
    assert [(s.write, s.tool, s.engine) for s in steps[:6]] == [
        (True, "fio", None), (True, "python", None), (True, "deepnvme", "aio"),
        (False, "deepnvme", "aio"), (False, "python", None), (False, "fio", None)]


def test_plan_steps_runs_deepnvme_once_per_engine() -> None:
    assert lanes(("deepnvme", "fio"), ("io_uring", "threads")) == [
        ("deepnvme", "io_uring"), ("deepnvme", "threads"), ("fio", None)]
    steps = plan_steps(tools=("deepnvme", "fio"), engines=("io_uring", "threads"), write=False,
                       read=True, loops=2, warmup=0)
    assert [(s.loop, s.tool, s.engine) for s in steps] == [
        (loop, t, e) for loop in (0, 1)
        for t, e in (("deepnvme", "io_uring"), ("deepnvme", "threads"), ("fio", None))]


def test_fio_command_and_parse() -> None:
    cmd = fio_command("fio", path="/x:y/f", write=True, io_size=1 << 20, block_size=65536,
                      queue_depth=8)
    assert "--filename=/x\\:y/f" in cmd and "--end_fsync=1" in cmd and "--direct=1" in cmd
    assert "--ioengine=libaio" in cmd and "--bs=65536" in cmd and "--iodepth=8" in cmd
    out = json.dumps({"jobs": [{"error": 0, "write": {"io_bytes": 1 << 20, "runtime": 4}}]})
    assert parse_fio_json("note: x\n" + out, write=True, io_size=1 << 20) == 0.004
    zero = json.dumps({"jobs": [{"error": 0, "read": {"io_bytes": 4096, "runtime": 0}}]})
    assert parse_fio_json(zero, write=False, io_size=4096) == 0.001
    with pytest.raises(DeepNVMeError, match="moved"):
        parse_fio_json(out, write=True, io_size=2 << 20)
    with pytest.raises(DeepNVMeError, match="parse"):
        parse_fio_json("garbage", write=True, io_size=1)


def test_fio_randread_command_and_latency() -> None:
    cmd = fio_command("fio", path="/f", write=False, io_size=1 << 20, block_size=4096,
                      queue_depth=32, random_order=True)
    assert "--rw=randread" in cmd and "--bs=4096" in cmd and "--iodepth=32" in cmd
    assert "--randrepeat=0" in cmd and "--direct=1" in cmd and "--end_fsync=1" not in cmd
    assert "--rw=read" in fio_command("fio", path="/f", write=False, io_size=1, block_size=1,
                                      queue_depth=1)
    out = json.dumps({"jobs": [{"error": 0, "read": {"io_bytes": 1 << 20, "runtime": 5,
                                                      "lat_ns": {"mean": 250_000.0}}}]})
    assert parse_fio_latency(out, write=False) == pytest.approx(250e-6)
    assert parse_fio_json(out, write=False, io_size=1 << 20) == 0.005
    with pytest.raises(DeepNVMeError, match="no latency"):
        parse_fio_latency(json.dumps({"jobs": [{"read": {}}]}), write=False)


def test_stats_and_sizes() -> None:
    assert Stats.of([3.0, 1.0, 2.0]) == Stats(1.0, 2.0, 3.0)
    assert fmt_size(1 << 30) == "1 GiB" and fmt_size(1536) == "1536 B"
    with pytest.raises(ValueError):
        Stats.of([])


def test_mount_of_picks_longest_prefix_and_unescapes(tmp_path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        f"23 22 259:0 / {tmp_path}/my\\040disk rw - xfs /dev/nvme0n1 rw\n")
    (tmp_path / "my disk" / "sub").mkdir(parents=True)
    m = mount_of(str(tmp_path / "my disk" / "sub"), mountinfo=str(info))
    assert (m.fstype, m.source, m.dev) == ("xfs", "/dev/nvme0n1", "259:0")
    assert mount_of(str(tmp_path), mountinfo=str(info)).fstype == "ext4"


def test_block_device_resolves_partitions(tmp_path) -> None:
    disk = tmp_path / "devices" / "nvme0n1"
    part = disk / "nvme0n1p1"
    (part).mkdir(parents=True)
    (part / "partition").write_text("1")
    (disk / "queue").mkdir()
    (disk / "queue" / "rotational").write_text("0\n")
    (disk / "queue" / "scheduler").write_text("[none] mq-deadline\n")
    (disk / "device").mkdir()
    (disk / "device" / "model").write_text("Fast NVMe 1TB\n")
    (tmp_path / "dev" / "block").mkdir(parents=True)
    (tmp_path / "dev" / "block" / "259:1").symlink_to(part)
    dev = block_device("259:1", sys_root=str(tmp_path))
    assert (dev.name, dev.model, dev.rotational, dev.scheduler) == (
        "nvme0n1", "Fast NVMe 1TB", False, "none")
    assert block_device("1:2", sys_root=str(tmp_path)) is None


def test_load_space_json_yaml_and_errors(tmp_path) -> None:
    f = tmp_path / "space.json"
    f.write_text(json.dumps({"aio": {"block_size": ["1M", "256K"], "thread_count": [2, 1],
                                     "single_submit": [True, False],
                                     "engine": ["threads", "io_uring"],
                                     "overlap_events": [True]}}))
    space = load_space(str(f))
    assert space.dims["block_size"] == (256 << 10, 1 << 20)
    assert space.dims["intra_op_parallelism"] == (1, 2)
    assert space.dims["queue_depth"] == default_space().dims["queue_depth"]
    assert space.dims["engine"] == ("io_uring", "threads")  # preference order, not file order
    assert space.dims["single_submit"] == (False, True)  # swept
    assert not any("single_submit is not swept" in n for n in space.notes)
    assert any("overlap_events" in n and "no effect" in n for n in space.notes)
    f.write_text(json.dumps({"single_submit": True}))
    assert any("written as true" in n for n in load_space(str(f)).notes)
    y = tmp_path / "space.yaml"
    y.write_text("queue_depth: [4, 16]\nintra_op_parallelism: 2\n")
    assert load_space(str(y)).dims["queue_depth"] == (4, 16)
    for bad in ({"nope": [1]}, {"block_size": []}, {"queue_depth": [0]},
                {"overlap_events": ["true"]}, {"engine": ["auto"]}, {"engine": ["spdk"]},
                {"single_submit": [1]}):
        f.write_text(json.dumps(bad))
        with pytest.raises(ConfigError):
            load_space(str(f))


def test_default_space_and_trial_scores() -> None:
    space = default_space()
    assert tuple(space.dims) == DIMENSIONS and space.size == 200 * len(ENGINE_NAMES)
    assert space.dims["engine"] == ENGINE_NAMES and space.dims["single_submit"] == (False,)
    assert any("single_submit is not swept: it is written as false" in n for n in space.notes)
    t = Trial(1 << 20, 32, 2, write_gbps=1.0, read_gbps=3.0, seconds=0.1, engine="aio")
    assert t.combined_gbps == pytest.approx(1.5)
    aio = t.config().to_deepspeed()["aio"]
    assert aio["intra_op_parallelism"] == 2 and aio["single_submit"] is False
    assert aio["engine"] == "aio" and IOConfig.from_deepspeed({"aio": aio}) == t.config()
    assert t.to_dict()["engine"] == "aio"


def _statuses(*available: str) -> tuple[EngineStatus, ...]:
    first = next(n for n in ENGINE_NAMES if n in available)
    return tuple(EngineStatus(n, n in available, f"{n} detail", n == first) for n in ENGINE_NAMES)


def test_coordinate_search_over_engine_names_tries_each_once() -> None:
    seen: list[tuple] = []
    speed = {"io_uring": 3.0, "aio": 5.0, "threads": 1.0}

    def score(point):
        seen.append(point)
        d = dict(point)
        return speed[d["engine"]] - abs(d["q"] - 32) / 64

    best = coordinate_search({"engine": ENGINE_NAMES, "q": (8, 32, 128)},
                             {"engine": "io_uring", "q": 128}, score)
    assert dict(best) == {"engine": "aio", "q": 32}
    assert {dict(p)["engine"] for p in seen} == set(ENGINE_NAMES)


def test_tune_start_point_runnable_and_complete() -> None:
    dims = {"engine": ("aio", "threads"), "intra_op_parallelism": (2, 4),
            "block_size": (256 << 10, 4 << 20), "queue_depth": (8, 128),
            "single_submit": (True,)}
    assert start_point(dims, "aio") == {"engine": "aio", "intra_op_parallelism": 2,
                                        "block_size": 256 << 10, "queue_depth": 128,
                                        "single_submit": True}
    assert start_point(dims, "io_uring")["engine"] == "aio"  # auto's pick not in the space
    space = runnable(default_space(), _statuses("aio", "threads"))
    assert space.dims["engine"] == ("aio", "threads") and space.size == 400
    assert "engine io_uring not swept: not available here (io_uring detail)" in space.notes
    with pytest.raises(DeepNVMeError, match="none of the engines to sweep runs here"):
        runnable(TuneSpace({**default_space().dims, "engine": ("io_uring",)}),
                 _statuses("threads"))
    partial = complete(TuneSpace({"queue_depth": (4,)}, ("n",)))
    assert tuple(partial.dims) == DIMENSIONS and partial.dims["queue_depth"] == (4,)
    assert partial.notes == ("n",)


def test_parse_engines_and_require_engines() -> None:
    assert parse_engines(" io_uring, THREADS ,io_uring") == ("io_uring", "threads")
    assert parse_engines("auto") == ("auto",)
    for bad, msg in (("", "empty"), (",", "empty"), ("aio,spdk", "unknown engine 'spdk'")):
        with pytest.raises(ConfigError, match=msg):
            parse_engines(bad)
    statuses = _statuses("aio", "threads")
    assert require_engines(("auto", "aio", "threads"), statuses) == ("aio", "threads")
    with pytest.raises(DeepNVMeError, match="engine 'io_uring' is not available here: "
                                            "io_uring detail .*available: aio, threads"):
        require_engines(("threads", "io_uring"), statuses)
    with pytest.raises(ConfigError, match="unknown engine 'spdk'"):  # BenchOptions(engines=...)
        require_engines(("spdk",), statuses)


def test_in_flight_per_engine() -> None:
    c = IOConfig(queue_depth=16, intra_op_parallelism=3)
    assert in_flight(c, "io_uring") == in_flight(c, "aio") == 48
    assert in_flight(c, "threads") == 16


def test_random_reads_cover_every_block_once_in_a_new_order() -> None:
    buf = torch.arange(64 * 1024, dtype=torch.int64).to(torch.uint8)
    reads = RandomReads(buf, 4096, seed=1)
    first, second = reads.items(), reads.items()
    assert reads.count == 16 and len(first) == 16
    for items in (first, second):
        assert sorted(off for _, off in items) == list(range(0, 64 * 1024, 4096))
        for view, off in items:  # each view is the buffer's bytes at the file offset
            assert view.numel() == 4096 and view.data_ptr() == buf.data_ptr() + off
    assert [o for _, o in first] != [o for _, o in second]
    with pytest.raises(ValueError):
        RandomReads(torch.empty(5000, dtype=torch.uint8), 4096)


def test_random_read_stats_and_speedup_keys() -> None:
    # 2 processes, 1 MiB each as 256 reads of 4 KiB, loops of 0.5 s and 0.25 s end to end
    row = OpStats("deepnvme", "randread", 1 << 20, 2, (0.4, 0.5, 0.2, 0.25), (0.5, 0.25),
                  engine="io_uring", random_size=4096, latency_seconds=(1e-3, 2e-3, 3e-3, 4e-3))
    assert row.reads == 256
    assert row.iops == Stats(1024.0, 1536.0, 2048.0)
    assert row.mbps.median == pytest.approx(1536 * 4096 / 1e6)
    assert row.read_latency.median == pytest.approx(2.5e-3)
    d = row.to_dict()
    assert d["engine"] == "io_uring" and d["reads"] == 256 and d["IOPS"]["max"] == 2048.0
    other = OpStats("deepnvme", "randread", 1 << 20, 2, (1.0,) * 4, (1.0, 1.0), engine="threads",
                    random_size=4096, latency_seconds=(1e-3,) * 4)
    fio = OpStats("fio", "randread", 1 << 20, 2, (0.5,) * 4, (0.5, 0.5), engine="libaio",
                  random_size=4096, latency_seconds=(1e-3,) * 4)
    result = BenchResult(("/d",), ("ext4",), 1 << 20, 2, 2, 0, IOConfig(), True, True, False,
                         ("deepnvme", "fio"), (row, other, fio), (),
                         engines=("io_uring", "threads"), random_size=4096)
    speed = result.to_dict()["speedup"]
    # the median of the rates 2 and 4 (per s) over 1 (threads) and over 2 (fio)
    assert speed == {"randread_vs_deepnvme-threads": pytest.approx(3.0),
                     "randread_vs_fio": pytest.approx(1.5)}
    assert result.speedup("fio", "randread") == speed["randread_vs_fio"]
    assert result.ratio(row) is None


def test_report_engine_lines() -> None:
    checks = _engine_checks(_statuses("aio", "threads"))
    assert [(c.name, c.status) for c in checks] == [
        ("engine io_uring", "WARN"), ("engine aio", "OK"), ("engine threads", "OK"),
        ("engine auto", "OK")]
    assert checks[0].value == "not available: io_uring detail" and checks[0].hint
    assert checks[1].value == "available: aio detail" and not checks[1].hint
    assert checks[3].value.startswith("aio (the first available of io_uring, aio, threads)")
    none = tuple(EngineStatus(n, False, "x", False) for n in ENGINE_NAMES)
    assert _engine_checks(none)[-1].status == "FAIL"
