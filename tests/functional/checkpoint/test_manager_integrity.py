"""CheckpointManager under SIGKILL, with checksums, and ``deepnvme verify``/``plan`` exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import deepnvme
from deepnvme.checkpoint.manager._steps import FILE, read_manifest, step_dir
from deepnvme.cli.main import main
from deepnvme.formats.torchsave import torch_layout

_CHILD = textwrap.dedent("""
    import sys, torch, deepnvme
    mgr = deepnvme.CheckpointManager(sys.argv[1], keep=2, staging=sys.argv[2], checksums=True)
    step = (mgr.latest_step() or 0) + 1
    w = torch.nn.Parameter(torch.full((1 << 20,), float(step)))
    w.grad = torch.full_like(w, -1.0)
    opt = torch.optim.SGD([w], lr=1.0)  # each step() adds 1: w == step at save (fenced: hooked)
    while True:
        mgr.save(step, {"w": w, "opt": opt, "b": torch.arange(step, step + 1000), "step": step})
        if step % 3 == 0:
            mgr.wait()
            print("committed", flush=True)
        opt.step()
        step += 1
""")


def _env():
    return {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(deepnvme.__file__))}


@pytest.mark.parametrize("mode", ["snapshot", "fenced"])
def test_sigkill_mid_save_leaves_only_complete_checkpoints(tmp_path, mode):
    for delay in (0.03, 0.17):
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), mode],
                                stdout=subprocess.PIPE, env=_env())
        try:
            assert proc.stdout.readline().strip() == b"committed"
            time.sleep(delay)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        reader = deepnvme.CheckpointManager(tmp_path)  # removes what the killed save left
        steps = reader.steps()
        assert steps and len(steps) <= 3  # keep=2, plus at most one not yet retired
        for step in steps:  # every listed step is complete and verifies
            got = reader.load(step)
            assert got["step"] == step and torch.equal(got["w"], torch.full((1 << 20,), float(step)))
            assert torch.equal(got["b"], torch.arange(step, step + 1000))
        w = torch.nn.Parameter(torch.empty(1 << 20))
        state = {"w": w, "opt": torch.optim.SGD([w], lr=1.0), "b": torch.empty(1000, dtype=torch.int64),
                 "step": None}
        assert reader.restore(state) == steps[-1] and state["step"] == steps[-1]
        assert torch.equal(w.detach(), torch.full((1 << 20,), float(steps[-1])))
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".step-")]
        reader.close()


def _corrupt(directory, step: int, name: str) -> None:
    """Flip one byte inside tensor ``name``'s record of ``step``'s state.pt."""
    path = os.path.join(step_dir(str(directory), step), FILE)
    where = torch_layout(path)[name].offset + 5
    with open(path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("algorithm", [True, "crc32c", "xxh64"])
def test_checksums_catch_a_flipped_byte(tmp_path, algorithm, capsys):
    pytest.importorskip("xxhash" if algorithm == "xxh64" else "crc32c")
    with deepnvme.CheckpointManager(tmp_path, checksums=algorithm, rng=False, keep=None) as mgr:
        mgr.save(1, {"w": torch.randn(50_000), "v": torch.randn(30_000)})
        mgr.save(2, {"w": torch.randn(50_000), "v": torch.randn(30_000)})
    assert read_manifest(step_dir(str(tmp_path), 2))["checksum"] == ("crc32c" if algorithm is True else algorithm)
    assert main(["verify", str(tmp_path)]) == 0
    assert "checksums match" in capsys.readouterr().out
    _corrupt(tmp_path, 2, "v")
    with pytest.raises(deepnvme.CheckpointCorruptError, match=r"step 2: tensor 'v' fails its") as info:
        mgr.load()
    assert isinstance(info.value, deepnvme.DeepNVMeError)
    with pytest.raises(deepnvme.CheckpointCorruptError, match="step 2: tensor 'v'"):
        deepnvme.CheckpointManager(tmp_path).load()  # a reader opened without checksums= checks them too
    with pytest.raises(deepnvme.CheckpointCorruptError, match="'v'"):
        mgr.restore({"w": torch.empty(50_000), "v": torch.empty(30_000)})
    assert mgr.load(1)["w"].numel() == 50_000  # the other step is fine
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT  step 2" in out and "'v'" in out and "ok       step 1" in out
    assert main(["verify", str(step_dir(str(tmp_path), 1))]) == 0  # one step directory


def test_verify_without_checksums_checks_structure_and_says_so(tmp_path, capsys):
    with deepnvme.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.randn(10_000)})
        mgr.save(2, {"w": torch.randn(10_000)})
    assert main(["verify", str(tmp_path)]) == 0
    assert "checksums were absent" in capsys.readouterr().out
    path = os.path.join(step_dir(str(tmp_path), 2), FILE)
    os.truncate(path, os.path.getsize(path) - 100)
    assert main(["verify", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == 1
    bad = [c for c in report["checkpoints"] if c["problem"]]
    assert len(bad) == 1 and "step 2" in bad[0]["problem"] and "bytes; the manifest says" in bad[0]["problem"]
    os.unlink(path)
    assert main(["verify", str(step_dir(str(tmp_path), 2))]) == 1
    assert "incomplete" in capsys.readouterr().out


def test_verify_no_checkpoint_is_exit_2(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    assert "no checkpoint" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "missing")]) == 2


def test_verify_of_only_leftovers_is_exit_2_and_names_them(tmp_path, capsys):
    leftover = tmp_path / ".step-3.deepnvme-building-123-abc"   # a save killed before its commit
    leftover.mkdir()
    assert main(["verify", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert f"note     {leftover}: left by an interrupted save" in out and "no checkpoint" in out
    assert main(["verify", str(tmp_path), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["leftovers"] == [str(leftover)]


def test_plan_json_and_measure(tmp_path, capsys):
    assert main(["plan", "--checkpoint-gb", "100", "--write-gbps", "10", "--step-seconds", "2",
                 "--mtbf-hours", "24", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["save_seconds"] == pytest.approx(10.0) and plan["interval_steps"] == 657
    assert plan["overlap_min_interval_steps"] == 5 and 0 < plan["overhead_fraction"] < 0.1
    assert plan["interval_hours"] == pytest.approx(657 * 2 / 3600)
    assert main(["plan", "--checkpoint-gb", "100", "--write-gbps", "10", "--step-seconds", "2",
                 "--mtbf-hours", "24"]) == 0
    text = capsys.readouterr().out  # sqrt(2 x 10 s x 86400 s) = 1315 s = 657 steps of 2 s
    assert "one save takes 10.00 s" in text and "657 steps = 0.365 h (1315 s before rounding)" in text
    assert f"{plan['overhead_fraction']:.2%} of wall time" in text and "intervals >= 5 step(s)" in text
    assert main(["plan", "--checkpoint-gb", "0.01", "--measure", str(tmp_path), "--step-seconds", "1",
                 "--mtbf-hours", "1"]) == 0
    assert "one save takes" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []  # the measurement file is gone
    assert main(["plan", "--checkpoint-gb", "1", "--step-seconds", "1", "--mtbf-hours", "1"]) == 2


_KILL_AT = textwrap.dedent("""
    import os, sys, types, torch, deepnvme
    from deepnvme.checkpoint import _staging
    from deepnvme.checkpoint.manager import _commit, _steps
    directory, mode, point = sys.argv[1:4]

    def die(*args, **kwargs):
        print("dying", flush=True)
        os.kill(os.getpid(), 9)

    mgr = deepnvme.CheckpointManager(directory, keep=1, staging=mode, checksums=True)
    w = torch.nn.Parameter(torch.full((1 << 18,), 1.0))
    opt = torch.optim.SGD([w], lr=1.0)
    mgr.save(1, {"w": w, "opt": opt, "step": 1})
    mgr.wait()
    if point == "skeleton":  # on the training thread: skeleton written, no tensor bytes yet
        real = _staging.write_skeleton
        _staging.write_skeleton = lambda obj, file: (real(obj, file), die())
    elif point == "publish":  # every byte and the manifest written, not yet renamed into place
        _commit.durable = types.SimpleNamespace(publish_dir=die)
    else:  # "retire": step 2 committed, step 1 renamed away and being deleted
        _steps.shutil = types.SimpleNamespace(rmtree=die)
    with torch.no_grad():
        w.fill_(2.0)
    mgr.save(2, {"w": w, "opt": opt, "step": 2})
    mgr.wait()
    print("survived", flush=True)
""")


@pytest.mark.parametrize("mode", ["snapshot", "fenced"])
@pytest.mark.parametrize("point, newest, leftover", [("skeleton", 1, "building"), ("publish", 1, "building"),
                                                    ("retire", 2, "deleting")])
def test_sigkill_at_each_stage_of_a_save(tmp_path, caplog, mode, point, newest, leftover):
    proc = subprocess.run([sys.executable, "-c", _KILL_AT, str(tmp_path), mode, point], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL and proc.stdout == "dying\n", proc.stderr
    hidden = [n for n in os.listdir(tmp_path) if n.startswith(".step-")]
    assert len(hidden) == 1 and f".deepnvme-{leftover}-" in hidden[0]  # the kill left one behind
    assert main(["verify", str(tmp_path)]) == 0  # the committed step is whole; the leftover is no step
    with caplog.at_level("WARNING", logger="deepnvme"):
        reader = deepnvme.CheckpointManager(tmp_path)
    assert f"removed {tmp_path / hidden[0]}" in caplog.text and not (tmp_path / hidden[0]).exists()
    assert reader.steps() == [newest]
    w = torch.nn.Parameter(torch.zeros(1 << 18))
    state = {"w": w, "opt": torch.optim.SGD([w], lr=1.0), "step": None}
    assert reader.restore(state) == newest and state["step"] == newest
    assert torch.equal(w.detach(), torch.full((1 << 18,), float(newest)))


def test_verify_names_a_step_directory_that_lost_its_manifest(tmp_path, capsys):
    with deepnvme.CheckpointManager(tmp_path, keep=None) as mgr:
        mgr.save(1, {"w": torch.randn(1000)})
        mgr.save(2, {"w": torch.randn(1000)})
    os.unlink(os.path.join(step_dir(str(tmp_path), 1), "manifest.json"))
    assert mgr.steps() == [2]  # not a committed checkpoint any more
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "step 1: checkpoint step 1 is incomplete" in out and "manifest.json' is missing" in out
    assert "ok       step 2" in out and "1 of 2 checkpoints intact" in out
