"""NVMeOptimizer(fuse_backward=True): each sub-group is updated inside the backward pass, bitwise
as the wrapped optimizer after it, with parameters in memory or offloaded (gradients then never
written: fewer bytes move), sliced parameters included; gradient accumulation is refused."""

import copy

import pytest
import torch
from torch import nn

import deepnvme
from deepnvme.offload import offload_parameters

BIG = 256 * 256 * 4


def models():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Tanh(), nn.Linear(256, 32), nn.Tanh(),
                      nn.Linear(32, 4))
    return a, copy.deepcopy(a)


def train(model, opt, steps=3):
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 256, generator=g)).pow(2).sum().backward()
        opt.step()


@pytest.mark.parametrize("where", ["memory", "offload", "offload-sliced"])
@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                                    (torch.optim.SGD, dict(lr=0.1, momentum=0.9))], ids=["AdamW", "SGD"])
def test_fused_update_is_bitwise_the_update_after_the_backward(tmp_path, where, cls, kw):
    ref_model, model = models()
    off = None
    if where != "memory":
        budget = BIG if where == "offload-sliced" else 4 * BIG
        off = offload_parameters(model, tmp_path / "p", max_in_memory_bytes=budget)
    opt = deepnvme.NVMeOptimizer(model.parameters(), cls, swap_dir=tmp_path / "s",
                                 fuse_backward=True, sub_group_bytes=BIG // 4, **kw)
    try:
        assert opt.num_sliced_params == 1
        train(ref_model, cls(ref_model.parameters(), **kw))
        if off is not None:
            off.reset_stats()
        train(model, opt)
        got = off.state_dict() if off is not None else model.state_dict()
        for name, value in ref_model.state_dict().items():
            assert torch.equal(value, got[name]), name
        assert all(p.grad is None for p in model.parameters())
        if off is not None:
            # no gradient written: 3 steps x (each parameter written once, by its update)
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            assert off.stats().bytes_written <= 3 * params
    finally:
        opt.close()
        if off is not None:
            off.close()


def test_gradient_accumulation_is_refused(tmp_path):
    _, model = models()
    opt = deepnvme.NVMeOptimizer(model.parameters(), torch.optim.SGD, swap_dir=tmp_path,
                                 fuse_backward=True, lr=0.1)
    try:
        x = torch.randn(2, 256)
        model(x).sum().backward()
        with pytest.raises(RuntimeError, match="accumulation.*fuse_backward=False"):
            model(x).sum().backward()               # its forward sees updated parameters
        opt.step()
        first, second = (model[4](torch.randn(2, 32)).sum() for _ in range(2))  # both forwards first
        first.backward()
        with pytest.raises(RuntimeError, match="accumulated.*fuse_backward=False"):
            second.backward()                       # a second gradient before step()
    finally:
        opt.close()
