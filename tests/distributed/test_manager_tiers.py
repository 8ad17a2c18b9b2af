"""CheckpointManager tiers: node-local directories, replicas on other nodes, a durable directory."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

import deepnvme
from deepnvme.checkpoint.manager import _durable

from . import _tier_workers, _workers
from ._ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")


def test_two_nodes_replicas_and_durable_then_one_process_reads_durable(tmp_path):
    run_ranks(_tier_workers.nodes_replicas_durable, 2, str(tmp_path), str(tmp_path), 1, deadline=150)
    # the durable step restores into one process without torch.distributed (W=2 -> 1)
    model, opt = _workers.model_and_optim(ddp=False)
    for p in model.parameters():
        p.data.zero_()
    state = {"model": model, "optim": opt, "meta": {"epoch": -1}}
    with deepnvme.CheckpointManager(str(tmp_path / "elsewhere"), durable=str(tmp_path / "durable")) as mgr:
        assert mgr.latest_step() == 3
        assert mgr.restore(state) == 3
    assert state["meta"] == {"epoch": 3}
    assert any(p.abs().sum() > 0 for p in model.parameters())


@pytest.mark.slow
def test_four_ranks_on_two_nodes(tmp_path):
    run_ranks(_tier_workers.nodes_replicas_durable, 4, str(tmp_path), str(tmp_path), 2, deadline=280)


def test_restore_sends_only_what_a_node_reads_and_a_lost_node_heals(tmp_path):
    run_ranks(_tier_workers.heal_and_count, 2, str(tmp_path), str(tmp_path), 1, deadline=200)


@pytest.mark.slow
def test_restore_on_four_nodes_sends_only_the_lost_nodes_files_and_heals(tmp_path):
    run_ranks(_tier_workers.heal_and_count, 4, str(tmp_path), str(tmp_path), 1, deadline=300)


def test_files_travel_in_byte_ranges(tmp_path):
    run_ranks(_tier_workers.ranges, 2, str(tmp_path), str(tmp_path), deadline=60)


def test_one_process_durable_drain_skips_when_behind_and_close_drains(tmp_path, caplog):
    gate, real = threading.Event(), _durable.copy_file
    first: list[str] = []

    def held(src: str, dst: str) -> None:
        if not first:
            first.append(src)
            assert gate.wait(30)
        real(src, dst)

    local, lasting = tmp_path / "local", tmp_path / "durable"
    _durable.copy_file = held
    try:
        with caplog.at_level(logging.INFO, logger="deepnvme"):
            mgr = deepnvme.CheckpointManager(local, keep=2, durable=lasting, keep_durable=3, rng=False)
            for step in range(1, 6):
                assert mgr.save(step, {"t": torch.full((4,), float(step))})
                mgr.wait()  # committed and offered; the drain still copies step 1
            gate.set()
            mgr.close()
    finally:
        _durable.copy_file = real
    assert sorted(os.listdir(lasting)) == [".deepnvme-writer.lock", "step-000000000001", "step-000000000005"]
    assert "steps [2, 3, 4] are not copied" in caplog.text
    assert sorted(os.listdir(local))[-2:] == ["step-000000000004", "step-000000000005"]
    # the local tier lost: the durable one serves the step (one process)
    with deepnvme.CheckpointManager(tmp_path / "new", durable=lasting, keep_durable=3) as mgr:
        assert mgr.steps() == [1, 5]
        got = {"t": torch.zeros(4)}
        assert mgr.restore(got) == 5 and torch.equal(got["t"], torch.full((4,), 5.0))
        assert mgr.load(1)["t"].tolist() == [1.0] * 4


def test_durable_every_and_keep_durable(tmp_path):
    lasting = tmp_path / "durable"
    with deepnvme.CheckpointManager(tmp_path / "local", keep=1, durable=lasting, durable_every=2,
                                    keep_durable=2) as mgr:
        for step in range(1, 8):
            mgr.save(step, {"t": torch.tensor([step])})
            mgr.wait()
    # the 2nd, 4th and 6th committed steps are offered; retention keeps two; a copy is stock torch.load-able
    assert sorted(n for n in os.listdir(lasting) if n.startswith("step-")) == ["step-000000000004",
                                                                                "step-000000000006"]
    assert torch.load(lasting / "step-000000000006" / "state.pt", weights_only=True)["t"].tolist() == [6]


def test_tier_options_are_checked():
    with pytest.raises(ValueError, match="replicas"):
        deepnvme.CheckpointManager("/tmp/x", replicas=3)
    with pytest.raises(ValueError, match="at least two nodes"):
        deepnvme.CheckpointManager("/tmp/x", replicas=2)
    with pytest.raises(ValueError, match="need durable=PATH"):
        deepnvme.CheckpointManager("/tmp/x", keep_durable=2)
    with pytest.raises(ValueError, match="durable_every"):
        deepnvme.CheckpointManager("/tmp/x", durable="/tmp/y", durable_every=0)
