"""CheckpointManager.restore reads into the state's existing tensors where they fit."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import deepnvme
from deepnvme.checkpoint.manager._steps import FILE, step_dir
from deepnvme.formats.torchsave import torch_skeleton


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
    return model, opt


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m/{k}": v for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"o/{i}/{k}": v for k, v in st.items()})
    return out


def _ptrs(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in tensors.items()}


@pytest.mark.parametrize("checksums", [False, True])
def test_restore_fills_existing_tensors_in_place(tmp_path, checksums, caplog):
    if checksums:
        pytest.importorskip("crc32c")
    model, opt = _trained(0)
    extra = torch.randn(1000, dtype=torch.float64)
    with deepnvme.CheckpointManager(tmp_path, checksums=checksums, rng=False) as mgr:
        mgr.save(5, {"model": model, "opt": opt, "extra": extra, "n": 7})
    want = {k: v.clone() for k, v in _tensors(model, opt).items()}
    other, other_opt = _trained(1)  # same shapes, other values, optimizer state present
    target_extra = torch.zeros(1000, dtype=torch.float64)
    before = _ptrs(_tensors(other, other_opt))
    state = {"model": other, "opt": other_opt, "extra": target_extra, "n": 0}
    extra_ptr = target_extra.data_ptr()
    with caplog.at_level(logging.DEBUG, logger="deepnvme.checkpoint.manager._restore"):
        assert mgr.restore(state) == 5
    assert "new memory" not in caplog.text  # every record went straight into its tensor
    got = _tensors(other, other_opt)
    assert _ptrs(got) == before and target_extra.data_ptr() == extra_ptr  # no new memory
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v) and got[k].dtype == v.dtype, k  # bitwise: same dtype, values
    assert torch.equal(target_extra, extra) and state["n"] == 7
    assert other_opt.param_groups[0]["lr"] == 0.01


def test_restore_falls_back_for_missing_optimizer_state(tmp_path, caplog):
    model, opt = _trained(0)
    with deepnvme.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "opt": opt})
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)  # no state before its first step
    before = _ptrs({f"m/{k}": v for k, v in fresh.state_dict().items()})
    with caplog.at_level(logging.DEBUG, logger="deepnvme.checkpoint.manager._restore"):
        mgr.restore({"model": fresh, "opt": fresh_opt})
    assert "read into new memory" in caplog.text
    assert _ptrs({f"m/{k}": v for k, v in fresh.state_dict().items()}) == before
    got, want = _tensors(fresh, fresh_opt), _tensors(model, opt)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert fresh_opt.param_groups[0]["lr"] == 0.01


def test_restore_dtype_change_goes_through_new_memory(tmp_path):
    with deepnvme.CheckpointManager(tmp_path, rng=False) as mgr:
        mgr.save(1, {"w": torch.arange(10, dtype=torch.float32)})
    target = torch.zeros(10, dtype=torch.float64)
    mgr.restore({"w": target})
    assert torch.equal(target, torch.arange(10, dtype=torch.float64))


def test_restore_module_mismatch_raises_before_any_byte_changes(tmp_path):
    model, opt = _trained(0)
    with deepnvme.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "opt": opt})
    other = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 5))
    snapshot = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(deepnvme.CheckpointMismatchError, match="model/2.weight") as info:
        mgr.restore({"model": other, "opt": torch.optim.Adam(other.parameters())})
    assert ("model/2.bias", (4,), (5,)) in info.value.mismatched
    assert all(torch.equal(v, snapshot[k]) for k, v in other.state_dict().items())


def test_restore_in_place_still_catches_corruption(tmp_path):
    pytest.importorskip("crc32c")
    model, opt = _trained(0)
    with deepnvme.CheckpointManager(tmp_path, checksums=True) as mgr:
        mgr.save(1, {"model": model, "opt": opt})
    path = os.path.join(step_dir(str(tmp_path), 1), FILE)
    obj, keys, spans = torch_skeleton(path)
    where = spans[keys[obj["model"]["0.weight"].untyped_storage()._cdata]].offset + 9
    with open(path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0x10]))
    other, other_opt = _trained(1)
    with pytest.raises(deepnvme.CheckpointCorruptError, match=r"step 1: tensor 'model/0.weight' fails"):
        mgr.restore({"model": other, "opt": other_opt})
    # the check ran on the bytes read in place: the damaged weight is there, one byte off the saved one
    diff = other[0].weight.detach().view(torch.uint8).flatten() != model[0].weight.detach().view(torch.uint8).flatten()
    assert diff.sum().item() == 1
