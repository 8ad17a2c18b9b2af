"""No litter: bench and tune remove their files on SIGINT and SIGTERM (exit 130 / 143), and
files of killed (SIGKILL) processes are removed by ``deepnvme clean``, the next bench or tune."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepnvme.io.durable import host_tag

BIG = ("--io-size", "16M", "--loops", "1000")


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def working_files(directory: Path) -> list[str]:
    """The run's own temporary files, not the writability probe that the `--dir` and `--output`
    checks create and remove at once (waiting on that probe raced with the run's file)."""
    return [p.name for p in directory.iterdir()
            if p.name.startswith(".deepnvme-") and not p.name.startswith(".deepnvme-probe-")]


def _wait_for_files(leftovers, directory: Path, count: int) -> None:
    deadline = time.monotonic() + 90
    while len(working_files(directory)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(working_files(directory)) == count, leftovers(directory)


@pytest.mark.parametrize("command, procs", [("bench", "1"), ("bench", "2"), ("tune", "1")])
def test_sigterm_removes_temporary_files_and_exits_143(spawn, leftovers, tmp_path, command,
                                                       procs) -> None:
    argv = ["--procs", procs] if command == "bench" else ["--budget", "600", "--output", "-"]
    proc = spawn(command, "--dir", str(tmp_path), *BIG, *argv)
    _wait_for_files(leftovers, tmp_path, int(procs))
    time.sleep(1.0)  # inside the timed transfers
    proc.send_signal(signal.SIGTERM)  # what `kill PID` (or a job scheduler) sends
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "terminated" in err and "Traceback" not in err
    assert leftovers(tmp_path) == []


def test_ctrl_c_during_tune_removes_its_file(spawn, leftovers, tmp_path) -> None:
    proc = spawn("tune", "--dir", str(tmp_path), *BIG, "--budget", "600", "--output", "-",
                 start_new_session=True)
    _wait_for_files(leftovers, tmp_path, 1)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert leftovers(tmp_path) == []


def test_sigkill_leftovers_removed_by_clean_then_absent_for_next_bench(spawn, leftovers, run_cli,
                                                                      tmp_path) -> None:
    proc = spawn("bench", "--dir", str(tmp_path), *BIG, "--procs", "2", start_new_session=True)
    _wait_for_files(leftovers, tmp_path, 2)
    os.killpg(proc.pid, signal.SIGKILL)  # no handler runs: the files stay behind
    proc.communicate(timeout=60)
    left = leftovers(tmp_path)
    assert len(left) == 2 and all(f".deepnvme-tmp-{proc.pid}-" in n for n in left)

    code, out, err = run_cli("clean", str(tmp_path), "--dry-run")
    assert code == 0, err
    assert all(f"would remove {tmp_path / n}" in out for n in left)
    assert leftovers(tmp_path) == left  # a dry run removes nothing

    code, out, err = run_cli("clean", str(tmp_path))
    assert code == 0, err
    assert all(f"removed {tmp_path / n}" in out for n in left) and "removed 2 temporary" in out
    assert leftovers(tmp_path) == []


def test_killed_bench_leaves_no_worker_behind(spawn, leftovers, run_cli, tmp_path) -> None:
    proc = spawn("bench", "--dir", str(tmp_path), *BIG, "--procs", "2")
    _wait_for_files(leftovers, tmp_path, 2)
    time.sleep(1.0)
    proc.kill()  # only the parent: its two workers must not go on writing
    proc.communicate(timeout=60)
    assert len(leftovers(tmp_path)) == 2
    assert run_cli("clean", str(tmp_path))[0] == 0
    time.sleep(3.0)  # an orphaned worker would recreate its file before each write
    assert leftovers(tmp_path) == []


def test_next_bench_removes_a_killed_bench_files(spawn, leftovers, run_json, tmp_path) -> None:
    proc = spawn("bench", "--dir", str(tmp_path), *BIG, start_new_session=True)
    _wait_for_files(leftovers, tmp_path, 1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert len(leftovers(tmp_path)) == 1
    run_json("bench", "--dir", str(tmp_path), "--io-size", "1M", "--loops", "1")
    assert leftovers(tmp_path) == []


def _fabricate(directory: Path) -> dict[str, Path]:
    """A save's, a bench's and a legacy (no host tag) temporary file of a dead process, one of
    this (living) process, and one written on another machine."""
    dead, tag = _dead_pid(), host_tag()
    other = "0" * 8 if tag != "0" * 8 else "1" * 8
    names = {"save": f".ck.pt.deepnvme-tmp-{dead}-{tag}-abcd1234",
             "bench": f".deepnvme-bench-0.deepnvme-tmp-{dead}-{tag}-0123abcd",
             "legacy": f".ck.pt.deepnvme-tmp-{dead}-feedf00d",
             "alive": f".ck.pt.deepnvme-tmp-{os.getpid()}-{tag}-abcd1234",
             "remote": f".ck.pt.deepnvme-tmp-{dead}-{other}-abcd1234"}
    paths = {k: directory / n for k, n in names.items()}
    for p in paths.values():
        p.write_bytes(b"x" * 100)
    return paths


def test_clean_removes_only_files_of_dead_processes_on_this_machine(run_cli, tmp_path) -> None:
    paths = _fabricate(tmp_path)
    (tmp_path / "ck.pt").write_bytes(b"checkpoint")
    code, out, err = run_cli("clean", str(tmp_path))
    assert code == 0, err
    for key in ("save", "bench", "legacy"):
        assert not paths[key].exists() and f"removed {paths[key]}" in out
    assert paths["alive"].exists() and f"kept {paths['alive']} (process {os.getpid()} is running)" in out
    assert paths["remote"].exists() and "another machine" in out
    assert (tmp_path / "ck.pt").read_bytes() == b"checkpoint"
    code, out, _ = run_cli("clean", str(tmp_path))
    assert code == 0 and "removed 0 temporary files" in out


def test_clean_of_a_missing_directory_is_an_error(run_cli, tmp_path) -> None:
    code, _, err = run_cli("clean", str(tmp_path / "missing"))
    assert code == 2 and "is not a directory" in err


def test_tune_removes_dead_processes_files_first(run_cli, tmp_path) -> None:
    paths = _fabricate(tmp_path)
    code, _, err = run_cli("tune", "--dir", str(tmp_path), "--io-size", "1M", "--loops", "1",
                           "--budget", "1", "--output", "-")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        paths[k].name for k in ("alive", "remote"))
