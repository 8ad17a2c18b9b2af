"""``deepnvme report`` on real directories."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

from deepnvme import AioHandle
from deepnvme.config import ENGINE_NAMES
from deepnvme.io.engine import probe_engines

SRC = str(Path(__file__).resolve().parents[3] / "src")


def test_report_json_on_a_writable_dir(run_cli, leftovers, tmp_path) -> None:
    code, out, _ = run_cli("report", "--dir", str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] is True
    checks = {c["name"]: c for c in data["checks"]}
    for name in ("python", "torch", "deepnvme", "cuda", "gpudirect storage", "RLIMIT_MEMLOCK",
                 "mlock", "huge pages", "directory", "filesystem", "O_DIRECT", "dio alignment", "free space"):
        assert name in checks, name
    assert all(c["status"] in ("OK", "WARN", "FAIL") for c in data["checks"])
    assert all(c["hint"] for c in data["checks"] if c["status"] != "OK")
    assert checks["cuda"]["status"] == ("OK" if torch.cuda.is_available() else "WARN")
    assert checks["directory"]["status"] == "OK"
    assert leftovers(tmp_path) == []


def test_report_missing_dir_fails_with_hint(run_cli, tmp_path) -> None:
    code, out, _ = run_cli("report", "--dir", str(tmp_path / "nope"))
    assert code == 1
    assert "FAIL" in out and "does not exist" in out and "hint:" in out


def test_report_readonly_dir_fails(run_cli, tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    target = "/sys" if os.geteuid() == 0 else str(ro)  # root ignores permission bits
    code, out, _ = run_cli("report", "--dir", target, "--json")
    data = json.loads(out)
    assert code == 1 and data["ok"] is False
    bad = [c for c in data["checks"] if c["status"] == "FAIL"]
    assert bad[0]["name"] == "directory" and "cannot create files" in bad[0]["value"]


def test_report_as_console_script_module(spawn, tmp_path) -> None:
    proc = spawn("report", "--dir", str(tmp_path))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "deepnvme report for" in out and "O_DIRECT" in out


def test_report_names_every_engine_and_auto_s_pick(run_cli, monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("DEEPNVME_ENGINE", raising=False)
    code, out, _ = run_cli("report", "--dir", str(tmp_path), "--json")
    data = json.loads(out)
    probes = probe_engines()
    with AioHandle(engine="auto") as h:
        auto = h.engine
    assert [e["name"] for e in data["engines"]] == list(ENGINE_NAMES)
    for e, p in zip(data["engines"], probes):
        assert e["available"] is p.available and e["detail"] == p.detail
        assert e["auto"] is (e["name"] == auto)
    assert data["auto_engine"] == auto
    assert auto == next(p.name for p in probes if p.available)  # the first that runs here
    checks = {c["name"]: c for c in data["checks"]}
    for p in probes:
        c = checks[f"engine {p.name}"]
        assert c["status"] == ("OK" if p.available else "WARN")
        assert c["value"].startswith("available" if p.available else "not available")
    assert checks["engine auto"]["status"] == "OK" and checks["engine auto"]["value"].startswith(auto)
    code, out, _ = run_cli("report", "--dir", str(tmp_path))
    lines = [line for line in out.splitlines() if line.strip().split()[1:2] == ["engine"]]
    per_transfer = len(data["auto_per_transfer"])
    assert [line.split()[2] for line in lines] == [*ENGINE_NAMES, "auto"] + ["auto:"] * per_transfer
    assert [line.split()[0] for line in lines[:3]] == [
        "OK" if p.available else "WARN" for p in probes]


def test_report_says_which_mover_auto_gives_each_transfer_and_why(run_cli, monkeypatch,
                                                                  tmp_path) -> None:
    monkeypatch.delenv("DEEPNVME_ENGINE", raising=False)
    code, out, _ = run_cli("report", "--dir", str(tmp_path), "--json")
    data = json.loads(out)
    with AioHandle(engine="auto") as h:
        movers = h._engine.movers
    rows = {r["transfer"]: r for r in data["auto_per_transfer"]}
    checks = {c["name"]: c for c in data["checks"]}
    if set(movers) != {"io_uring", "aio"}:
        assert rows == {} and "per transfer" not in checks["engine auto"]["value"]
        return
    assert rows["file-extending write, 1 worker"]["mover"] == "io_uring"
    assert "synchronous" in rows["file-extending write, 1 worker"]["why"]
    assert rows["file-extending write, 2+ workers"]["mover"] == "aio"
    assert rows["large direct read"]["mover"] in movers
    for transfer, row in rows.items():
        assert checks[f"engine auto: {transfer}"]["value"] == f"{row['mover']}: {row['why']}"
    # without io_uring, auto has one mover and no per-transfer lines
    import dataclasses

    import deepnvme.io.engine as engine_mod

    fake = tuple(dataclasses.replace(p, available=False, detail="faked")
                 if p.name == "io_uring" else p for p in probe_engines())
    monkeypatch.setattr(engine_mod, "probe_engines", lambda: fake)
    code, out, _ = run_cli("report", "--dir", str(tmp_path), "--json")
    assert json.loads(out)["auto_per_transfer"] == []


def test_report_shows_an_unavailable_engine_with_why_and_a_hint(run_cli, monkeypatch,
                                                                 tmp_path) -> None:
    import dataclasses

    import deepnvme.io.engine as engine_mod

    fake = tuple(dataclasses.replace(p, available=False, detail="faked: io_uring_setup EPERM")
                 if p.name == "io_uring" else p for p in probe_engines())
    monkeypatch.setattr(engine_mod, "probe_engines", lambda: fake)
    monkeypatch.setenv("DEEPNVME_ENGINE", "threads")
    code, out, _ = run_cli("report", "--dir", str(tmp_path), "--json")
    data = json.loads(out)
    assert data["engines"][0] == {"name": "io_uring", "available": False,
                                  "detail": "faked: io_uring_setup EPERM", "auto": False}
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["engine io_uring"]["status"] == "WARN"
    assert checks["engine io_uring"]["value"] == "not available: faked: io_uring_setup EPERM"
    assert "kernel.io_uring_disabled" in checks["engine io_uring"]["hint"]
    assert "DEEPNVME_ENGINE=threads" in checks["engine auto"]["value"]
    assert code == 0 and data["ok"] is True  # a missing engine is a WARN, not a FAIL


def test_report_json_gives_numbers_and_booleans_as_json_types(run_cli, tmp_path) -> None:
    code, out, _ = run_cli("report", "--dir", str(tmp_path), "--json")
    assert code == 0
    facts = json.loads(out)["facts"]
    assert type(facts["free_bytes"]) is int and facts["free_bytes"] > 0
    st = os.statvfs(tmp_path)
    assert abs(facts["free_bytes"] - st.f_bavail * st.f_frsize) < 1 << 30
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    inf = resource.RLIM_INFINITY
    assert facts["memlock_unlimited"] is (soft == inf)
    assert facts["memlock_soft_bytes"] == (None if soft == inf else soft)
    assert facts["memlock_hard_bytes"] == (None if hard == inf else hard)
    assert facts["cpus"] == os.cpu_count() and facts["writable"] is True
    assert facts["cuda_devices"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert facts["huge_page_bytes"] is None or type(facts["huge_page_bytes"]) is int
    for key in ("mlock", "huge_pages", "o_direct", "gds", "fio"):
        assert type(facts[key]) is bool, key
    for key in ("dio_alignment_memory_bytes", "dio_alignment_offset_bytes"):
        assert facts[key] is None or (type(facts[key]) is int and facts[key] > 0), key
    if "rotational" in facts:
        assert type(facts["rotational"]) is bool
    assert not [k for k, v in facts.items() if isinstance(v, str) and v.strip().isdigit()]
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["free space"]["data"] == {"free_bytes": facts["free_bytes"]}
    assert checks["O_DIRECT"]["data"] == {"o_direct": facts["o_direct"]}


def test_report_json_on_a_missing_dir_says_not_writable(run_cli, tmp_path) -> None:
    code, out, _ = run_cli("report", "--dir", str(tmp_path / "nope"), "--json")
    assert code == 1 and json.loads(out)["facts"]["writable"] is False


def test_report_warns_about_spinning_openmp_threads_on_few_cores() -> None:
    from deepnvme.bench.report import _omp_check

    if not torch.backends.openmp.is_available():
        assert _omp_check(2, "").status == "OK"
        return
    unset = _omp_check(2, "")
    assert unset.status == "WARN" and "OMP_WAIT_POLICY=PASSIVE" in unset.hint
    assert unset.data == {"omp_wait_policy": None}
    active = _omp_check(4, "ACTIVE")
    assert active.status == "WARN" and "OMP_WAIT_POLICY=ACTIVE" in active.value
    assert _omp_check(2, "passive").status == "OK"
    assert _omp_check(64, "").status == "OK"  # cores to spare for the I/O


def _report_in(env: dict[str, str], tmp_path) -> dict[str, dict]:
    """``deepnvme report --json`` in a fresh process (torch reads these variables once)."""
    full = {**os.environ, **env, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "deepnvme.cli.main", "report", "--dir", str(tmp_path),
                          "--json"], env=full, capture_output=True, text=True, timeout=120)
    return {c["name"]: c for c in json.loads(out.stdout)["checks"]}


def test_report_tells_where_torch_puts_large_tensors(tmp_path) -> None:
    aligned = _report_in({"THP_MEM_ALLOC_ENABLE": "1", "OMP_WAIT_POLICY": "PASSIVE"}, tmp_path)
    assert aligned["tensor alignment"]["status"] == "OK"
    assert aligned["tensor alignment"]["data"] == {"torch_alloc_page_offset": 0}
    assert aligned["openmp wait"]["status"] == "OK"
    default = _report_in({"THP_MEM_ALLOC_ENABLE": "0"}, tmp_path)["tensor alignment"]
    offset = default["data"]["torch_alloc_page_offset"]
    assert 0 <= offset < 4096
    assert default["status"] == ("OK" if offset == 0 else "WARN")
    if offset:
        assert f"{offset} B past a page" in default["value"]
        assert "THP_MEM_ALLOC_ENABLE=1" in default["hint"]


def test_report_storage_json_carries_every_check(run_cli, tmp_path) -> None:
    code, out, _ = run_cli("report", "--storage", str(tmp_path), "--need", "1M", "--json")
    whole = json.loads(out)
    assert whole["volume"] is None and len(whole["reports"]) == 1
    data = whole["reports"][0]
    names = [c["name"] for c in data["checks"]]
    assert names[:2] == ["filesystem", "O_DIRECT"] and "free space" in names and len(names) == 11
    assert data["need_bytes"] == 1 << 20 and data["path"] == os.path.realpath(tmp_path)
    assert all(set(c) == {"name", "status", "value", "hint", "data", "command"} for c in data["checks"])
    assert code == (0 if data["ok"] else 1) and whole["ok"] is data["ok"]
    assert data["facts"]["free_bytes"] > 0 and data["facts"]["mount"]["fstype"]


def test_report_storage_table_and_a_need_that_cannot_fit(run_cli, tmp_path) -> None:
    code, out, _ = run_cli("report", "--storage", str(tmp_path), "--need", "1000000T")
    assert code == 1
    assert "storage under" in out and "free space" in out and "FAIL" in out
    assert f"deepnvme clean {tmp_path}" in out  # the fixing command, unwrapped below the table
    code, out, err = run_cli("report", "--storage", str(tmp_path / "nope"))
    assert code == 1 and f"mkdir -p {tmp_path / 'nope'}" in out


def test_report_need_without_storage_is_a_usage_error(run_cli) -> None:
    code, out, err = run_cli("report", "--need", "1G")
    assert code == 2 and out == "" and "--need goes with --storage PATH" in err


def test_report_storage_of_a_volume_on_one_drive_warns(run_cli, tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    code, out, _ = run_cli("report", "--storage", str(a), "--storage", str(b), "--json")
    data = json.loads(out)
    assert [r["path"] for r in data["reports"]] == [os.path.realpath(a), os.path.realpath(b)]
    assert data["volume"]["status"] == "WARN" and "share a drive" in data["volume"]["value"]
    code, out, _ = run_cli("report", "--storage", str(a), "--storage", str(b))
    assert out.count("storage under") == 2 and "WARN volume: 2 directories on 1 drive(s)" in out
