"""save_distributed on a one-process NCCL group: its collectives must not use CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import deepnvme

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                                 reason="needs a CUDA device and NCCL")]


def test_save_distributed_on_nccl_group(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        out = tmp_path / "out"
        out.mkdir()
        state = {"w": torch.randn(10_000), "step": 3}
        deepnvme.save_distributed(state, out / "ck.pt")
        back = torch.load(out / "ck.pt", weights_only=True)
        assert back["step"] == 3 and torch.equal(back["w"], state["w"])
        assert os.listdir(out) == ["ck.pt"]
    finally:
        dist.destroy_process_group()


def _manager_on_nccl(rank: int, world: int, directory: str) -> None:
    """Each rank on its own GPU, the training group NCCL: the manager's own groups are gloo, the
    state CUDA tensors; a bitwise round trip with the replicated tensors read once."""
    from tests.distributed._workers import same

    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt}
    with deepnvme.CheckpointManager(directory, checksums="crc32c", timeout=60) as mgr:
        assert mgr.save(1, state)
        mgr.wait()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        assert mgr.restore(state) == 1
    assert same(dict(model.state_dict()), expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_checkpoint_manager_across_two_nccl_ranks(tmp_path):
    pytest.importorskip("crc32c")
    import torch.multiprocessing as mp

    mp.start_processes(_nccl_entry, args=(2, str(tmp_path / "store"), str(tmp_path / "ck")), nprocs=2,
                       start_method="spawn")


def _nccl_entry(rank: int, world: int, store: str, directory: str) -> None:
    import datetime
    import faulthandler

    faulthandler.dump_traceback_later(150, exit=True)  # a hard deadline: a hang fails with stacks

    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        _manager_on_nccl(rank, world, directory)
    finally:
        dist.destroy_process_group()
