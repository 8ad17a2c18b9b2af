"""NVMeOptimizer.add_param_group with offloaded parameters (unfreezing layers mid-training):
the new group is updated through the offload, bitwise as in memory; a group whose update cannot
fit the budget is refused, naming the parameter, and leaves the optimizer as it was."""

import copy

import pytest
import torch
from torch import nn

import deepnvme
from deepnvme import OffloadMemoryError
from deepnvme.offload import offload_parameters


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def run(net, opt, steps, seed, extra=()):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        for t in extra:
            loss = loss + (t * t).sum()
        loss.backward()
        opt.step()


def test_a_group_added_later_trains_through_the_offload_bitwise(tmp_path):
    a = model()
    b = copy.deepcopy(a)
    # an in-memory tensor the loop also trains, larger than any layer, so the swap buffers sized
    # at construction hold the new sub-groups' state too
    extra_a = torch.zeros(16, 40, requires_grad=True)
    extra_b = extra_a.detach().clone().requires_grad_(True)
    ref = torch.optim.AdamW([extra_a], lr=1e-2)
    off = offload_parameters(b, tmp_path / "p", max_in_memory_bytes=16_000, min_offload_bytes=0)
    opt = deepnvme.NVMeOptimizer([extra_b], torch.optim.AdamW, swap_dir=tmp_path / "s", lr=1e-2)
    run(a, ref, 2, seed=1, extra=[extra_a])   # only `extra` is trained: the layers are frozen
    run(b, opt, 2, seed=1, extra=[extra_b])
    ref.add_param_group({"params": list(a.parameters()), "lr": 5e-3})
    opt.add_param_group({"params": list(b.parameters()), "lr": 5e-3})
    assert opt.sub_group_bytes <= 16_000 // 4   # fitted to the offload's budget when it joined
    run(a, ref, 3, seed=2, extra=[extra_a])
    run(b, opt, 3, seed=2, extra=[extra_b])
    for name, value in a.state_dict().items():
        assert torch.equal(value, off.state_dict()[name]), name
    assert torch.equal(extra_a, extra_b)
    assert off.stats().bytes_written > 0
    off.close()
    opt.close()


def test_a_group_that_cannot_be_updated_is_refused_and_not_added(tmp_path):
    net = model()
    off = offload_parameters(net, tmp_path / "p", max_in_memory_bytes=3_000, min_offload_bytes=0)
    keep = torch.zeros(4, requires_grad=True)
    # Adagrad: not updated in slices (SGD would update the weights in slices within the budget)
    opt = deepnvme.NVMeOptimizer([keep], torch.optim.Adagrad, swap_dir=tmp_path / "s", lr=0.1)
    before = (len(opt.param_groups), opt.sub_group_bytes)
    with pytest.raises(OffloadMemoryError, match=r"parameter \d\.weight needs"):
        opt.add_param_group({"params": list(net.parameters())})   # 2 KiB weights + gradients > 3 KB
    assert (len(opt.param_groups), opt.sub_group_bytes) == before and opt._offload is None
    off.close()
    opt.close()
