"""Small parameters (below ``min_offload_bytes``) stay in memory with their gradients: training
stays bitwise equal to memory, no file request is made for them, they count in the budget (at
most an eighth of it), and a failed optimizer update gives them their old values back."""

import os

import pytest
import torch
from torch import nn

import deepnvme
from deepnvme.offload import offload_parameters

from .test_offload_parameters import assert_same, batches, loss_of, make_pair, train

KEEP_SMALL_DEFAULT = True   # this module tests the default threshold (see conftest.py)


def resident_names(off):
    return sorted(d.name for d, _ in off._entries.values() if d.resident)


def files(off):
    return [f for f in os.listdir(off.directory) if f.endswith(".swp")]


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("opt_cls,kwargs", [(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
                                            (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})])
def test_training_with_resident_small_parameters_equals_memory_bitwise(tmp_path, accum, opt_cls,
                                                                       kwargs):
    a, b = make_pair()
    off = offload_parameters(b, tmp_path, max_in_memory_bytes=24_000, prefetch=2)
    # the budget's eighth (3000 B) holds some of the small tensors with their gradients, not all
    assert resident_names(off) == ["l1.bias", "l2.bias", "ln.bias", "ln.weight"]
    opt = deepnvme.NVMeOptimizer(b.parameters(), opt_cls, swap_dir=tmp_path / "opt", **kwargs)
    train(a, opt_cls(a.parameters(), **kwargs), 3, accum)
    train(b, opt, 3, accum)
    assert_same(a, off)
    for name, p in a.named_parameters():
        got = off.gradient(name)
        assert got is not None and torch.equal(p.grad, got), name
    largest = max(p.numel() * 4 for p in b.parameters())
    assert off.stats().peak_bytes <= 24_000 + largest   # + autograd's gradient being added
    opt.close()
    off.close()


def test_resident_parameters_make_no_file_requests(tmp_path):
    x, y = batches(1)[0]
    moved = {}
    for threshold in (0, None):
        _, b = make_pair()
        off = offload_parameters(b, tmp_path / str(threshold), max_in_memory_bytes=1 << 20,
                                 min_offload_bytes=threshold)
        off.reset_stats()
        loss_of(b, x, y).backward()
        off._store.wait_writes()
        s = off.stats()
        moved[threshold] = (s.bytes_read, s.bytes_written, len(files(off)))
        if threshold is None:   # a budget of 1 MiB keeps every (< 64 KiB) parameter in memory
            assert len(resident_names(off)) == len(off._entries)
            assert s.held_bytes >= 2 * sum(p.numel() * 4 for p in b.parameters())
            assert all(p.data.numel() == p.numel() and not p.data.isnan().any()
                       for p in b.parameters())   # the real values, not placeholders
        off.close()
    assert moved[None] == (0, 0, 0)
    assert moved[0][0] > 0 and moved[0][1] > 0 and moved[0][2] > 0


def test_resident_share_of_the_budget_is_capped(tmp_path):
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])   # 1088 B weight, 64 B bias
    off = offload_parameters(model, tmp_path, max_in_memory_bytes=4000)
    # 4000 // 8 = 500 B: two biases with their gradients and backups (2 x 3 x 64 B)
    assert resident_names(off) == ["0.bias", "1.bias"]
    off.close()
    with pytest.raises(ValueError, match="min_offload_bytes"):
        offload_parameters(model, tmp_path, max_in_memory_bytes=4000, min_offload_bytes=-1)


class FailingSGD(torch.optim.SGD):
    """Updates its parameters in place, then fails on the call numbered ``fail_at``."""

    calls = 0
    fail_at = -1

    def step(self, closure=None):
        FailingSGD.calls += 1
        out = super().step(closure)
        if FailingSGD.calls == FailingSGD.fail_at:
            raise RuntimeError("optimizer failed after updating")
        return out


def test_a_failed_update_gives_resident_parameters_their_old_values(tmp_path):
    _, b = make_pair()
    off = offload_parameters(b, tmp_path, max_in_memory_bytes=1 << 20)
    assert "l1.bias" in resident_names(off)
    before = {n: off.parameter(n) for n, _ in b.named_parameters()}
    opt = deepnvme.NVMeOptimizer(b.parameters(), FailingSGD, swap_dir=tmp_path / "opt", lr=0.5)
    FailingSGD.calls, FailingSGD.fail_at = 0, 1
    loss_of(b, *batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="optimizer failed"):
        opt.step()
    for name, value in before.items():   # the sub-group that failed: nothing changed
        assert torch.equal(off.parameter(name), value), name
    opt.close()
    off.close()
