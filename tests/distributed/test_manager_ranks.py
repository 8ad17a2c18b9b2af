"""CheckpointManager across 2 gloo ranks on CPU: replicated and DTensor state, failures, resharding to 1."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import deepnvme
from deepnvme.cli.main import main

from . import _workers
from ._ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")


def test_replicated_state_round_trip_failure_and_restore_into_one_process(tmp_path, caplog, capsys):
    directory = str(tmp_path / "ck")
    run_ranks(_workers.replicated, 2, str(tmp_path), directory)
    expected = torch.load(os.path.join(directory, "expected.pt"), weights_only=True)
    # W=2 -> 1 without torch.distributed: the same model, not wrapped, restored by DCP's resharding
    model, opt = _workers.model_and_optim(ddp=False)
    state = {"model": model, "optim": opt, "meta": {"epoch": 0, "name": ""}}
    with caplog.at_level(logging.WARNING), deepnvme.CheckpointManager(directory) as mgr:
        assert mgr.steps() == [2, 4]
        assert mgr.restore(state, step=2) == 2
        with pytest.raises(deepnvme.CheckpointFormatError, match="several ranks"):
            mgr.load()
    got = _workers.snapshot(model, opt)
    assert _workers.same(got["model"], expected["model"]) and _workers.same(got["optim"], expected["optim"])
    assert state["meta"] == {"epoch": 3, "name": "run"}
    assert "RNG states are left as they are" in caplog.text
    capsys.readouterr()
    assert main(["verify", directory]) == 0
    assert "files of several ranks" in capsys.readouterr().out
    os.truncate(os.path.join(directory, "step-000000000004", "__1_0.distcp"), 100)
    assert main(["verify", directory]) == 1


def test_dtensor_shards_round_trip_and_timeout_names_the_rank(tmp_path):
    single = str(tmp_path / "single")
    with deepnvme.CheckpointManager(single) as mgr:   # one process: step-1/state.pt
        mgr.save(1, {"t": torch.arange(5.0), "note": "one process"})
    run_ranks(_workers.sharded, 2, str(tmp_path), str(tmp_path / "ck"), single)


def test_checksums_and_rank_state_across_ranks(tmp_path, capsys):
    pytest.importorskip("xxhash")
    directory, single = str(tmp_path / "ck"), str(tmp_path / "single")
    with deepnvme.CheckpointManager(single) as mgr:
        mgr.save(1, {"t": torch.ones(2)}, rank_state={"cursor": 5})
    run_ranks(_workers.checked, 2, str(tmp_path), directory, single)
    capsys.readouterr()
    assert main(["verify", directory]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT  step 2" in out and "__1_0.distcp" in out and "xxh64" in out, out
    assert "ok       step 1" in out
    # restored by one process (another world size): the saved rank_state is refused unless skipped
    model, opt = _workers.model_and_optim(ddp=False)
    state = {"model": model, "optim": opt}
    with deepnvme.CheckpointManager(directory) as mgr:
        with pytest.raises(deepnvme.CheckpointMismatchError, match=r"\['pos', 'seen'\].*2 rank"):
            mgr.restore(state, step=1)
        with pytest.raises(deepnvme.CheckpointCorruptError, match="__1_0.distcp"):
            mgr.restore(state, step=2, rank_state="skip")
        assert mgr.restore(state, step=1, rank_state="skip") == 1
