"""The device path of offload_parameters (a model that trains on a GPU), run on the CPU with a
stand-in device (tests/fakes.py: separate device buffers, copies on background threads after a
delay): training equals training in memory bitwise, the device budget holds, copies run ahead
of the modules that need them, and the model keeps its parameters."""

import copy

import pytest
import torch
from torch import nn

import deepnvme
from deepnvme.errors import OffloadMemoryError
from deepnvme.offload._device_offload import DeviceParameterOffload, model_device

from ...fakes import FakeDevice
from .test_offload_parameters import TinyLM, batches, loss_of, make_pair, train


@pytest.fixture
def device():
    d = FakeDevice(delay=0.001)
    yield d
    d.close()


def offload(model, path, device, **kw):
    kw.setdefault("max_in_memory_bytes", 24_000)
    return DeviceParameterOffload(model, path, device=device, **kw)


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("opt_cls,kwargs", [(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
                                            (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})])
def test_training_on_the_device_equals_training_in_memory_bitwise(tmp_path, device, accum,
                                                                  opt_cls, kwargs):
    a, b = make_pair()
    params = list(b.parameters())
    expected = train(a, opt_cls(a.parameters(), **kwargs), 3, accum)
    off = offload(b, tmp_path, device, prefetch=2)
    opt = deepnvme.NVMeOptimizer(b.parameters(), opt_cls, swap_dir=tmp_path, sub_group_bytes=8_000,
                                 **kwargs)
    got = train(b, opt, 3, accum)
    assert len(got) == 6 and all(torch.equal(e, g) for e, g in zip(expected, got))
    assert list(b.parameters()) == params          # the model keeps its parameter objects
    got_state = off.state_dict()
    for name, value in a.state_dict().items():
        assert torch.equal(value, got_state[name]), name
    with torch.no_grad():
        x, _ = batches(1, seed=7)[0]
        assert torch.equal(a(x), b(x))
    stats, dev = off.stats(), off.device_stats()
    largest = max(p.numel() * p.element_size() for p in a.parameters())
    assert stats.peak_bytes <= stats.budget_bytes + largest
    assert dev.peak_bytes <= dev.budget_bytes and device.peak_bytes <= dev.budget_bytes
    assert dev.bytes_to_device > 0 and dev.bytes_to_host > 0 and dev.prefetch_hits > 0
    # between uses a parameter holds a one-element placeholder or a device copy kept for reuse
    kept = {p.untyped_storage().data_ptr(): p.numel() * p.element_size() for p in b.parameters()
            if p.untyped_storage().nbytes() > p.element_size()}
    assert sum(kept.values()) <= dev.budget_bytes
    off.close()
    opt.close()


def test_small_parameters_stay_on_the_device_and_train_bitwise(tmp_path, device):
    a, b = make_pair()
    expected = train(a, torch.optim.AdamW(a.parameters(), lr=1e-2), 2, 2)
    off = offload(b, tmp_path, device, min_offload_bytes=1_000)
    opt = deepnvme.NVMeOptimizer(b.parameters(), torch.optim.AdamW, swap_dir=tmp_path,
                                 sub_group_bytes=8_000, lr=1e-2)
    got = train(b, opt, 2, 2)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    dev = off.device_stats()
    assert dev.resident_bytes > 0
    assert torch.equal(b.ln.weight.detach(), a.ln.weight.detach())   # resident: its value
    for name, value in a.state_dict().items():
        assert torch.equal(value, off.state_dict()[name]), name
    off.close()
    opt.close()


def test_gradients_come_back_and_accumulate_until_zero_grad(tmp_path, device):
    a, b = make_pair()
    off = offload(b, tmp_path, device, offload_gradients=False)
    for x, y in batches(2):
        loss_of(a, x, y).backward()
        loss_of(b, x, y).backward()
    for name, p in a.named_parameters():
        assert torch.equal(off.gradient(name), p.grad), name
    off.zero_grad()
    assert off.gradient("l1.weight") is None
    assert all(p.grad is None for p in b.parameters())
    off.close()


class Stack(nn.Module):
    def __init__(self, n=6, dim=32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_copies_run_ahead_of_the_modules_within_the_device_budget(tmp_path, device):
    torch.manual_seed(0)
    model = Stack()
    unit = 32 * 32 * 4 + 32 * 4
    # host memory for the whole model: each read has landed when the prefetch looks, so the
    # copies ahead are issued at once (with reads in flight, they are issued when they land)
    off = offload(model, tmp_path, device, prefetch=2, max_in_memory_bytes=1 << 20)
    assert off.device_stats().budget_bytes == 4 * unit    # (prefetch + 2) x the largest unit
    seen = {}

    def record(i):
        def hook(module, args):   # runs after the offload's pre-hook
            seen[i] = {c.entry.name for c in off._copies.present.values()}
        return hook
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(record(i))
    x = torch.randn(4, 32)
    for _ in range(2):                      # the first pass learns the order
        model(x).sum().backward()
    for i in range(4):
        assert {f"layers.{i + 1}.weight", f"layers.{i + 2}.weight"} <= seen[i], (i, seen[i])
    assert off.device_stats().peak_bytes <= 4 * unit and device.peak_bytes <= 4 * unit
    assert off.device_stats().prefetch_hits >= 8
    off.close()


def test_no_prefetch_copies_each_unit_when_needed(tmp_path, device):
    model = Stack()
    off = offload(model, tmp_path, device, prefetch=0, max_in_memory_bytes=1 << 20)
    for _ in range(2):
        model(torch.randn(4, 32)).sum().backward()
    assert off.device_stats().prefetch_hits == 0
    off.close()


def test_a_module_larger_than_the_device_budget_is_refused_leaving_the_model_as_it_was(
        tmp_path, device):
    model = Stack(n=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    with pytest.raises(OffloadMemoryError, match=r"module 'layers.0' has 4224 bytes .* "
                                                 r"max_device_bytes=1000"):
        offload(model, tmp_path, device, max_device_bytes=1000, max_in_memory_bytes=1 << 20)
    assert list(model.parameters()) == params
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not model._forward_pre_hooks and not model.layers[0]._forward_pre_hooks
    assert not any(hasattr(p, "_deepnvme_offload") for p in params)
    model(torch.randn(2, 32)).sum().backward()      # a plain model again
    assert all(p.grad is not None for p in params)


class External(nn.Module):
    """The root's forward uses the embedding's weight as the output projection."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.mid = nn.Linear(32, 32)

    def forward(self, x):
        return nn.functional.linear(torch.tanh(self.mid(self.emb(x))), self.emb.weight)


def test_an_external_parameter_is_copied_for_the_module_that_uses_it(tmp_path, device):
    torch.manual_seed(0)
    a = External()
    b = copy.deepcopy(a)
    off = offload(b, tmp_path, device)
    deepnvme.offload.register_external_parameter(b, b.emb.weight)
    ref = torch.optim.SGD(a.parameters(), lr=0.1)
    opt = deepnvme.NVMeOptimizer(b.parameters(), torch.optim.SGD, swap_dir=tmp_path, lr=0.1)
    x, y = batches(1)[0]
    for _ in range(2):
        for model, o in ((a, ref), (b, opt)):
            o.zero_grad()
            nn.functional.cross_entropy(model(x).reshape(-1, 50), y.reshape(-1)).backward()
            o.step()
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    off.close()
    opt.close()


def test_a_device_budget_of_one_unit_trains_bitwise(tmp_path):
    """Every copy evicts another (a unit's own copies not among them), with slow copies."""
    device = FakeDevice(delay=0.001)
    a, b = make_pair()
    expected = train(a, torch.optim.AdamW(a.parameters(), lr=1e-2), 2, 2)
    unit = 32 * 64 * 4 + 64 * 4                   # l1: the largest unit
    off = offload(b, tmp_path, device, prefetch=3, max_device_bytes=unit)
    opt = deepnvme.NVMeOptimizer(b.parameters(), torch.optim.AdamW, swap_dir=tmp_path,
                                 sub_group_bytes=4_000, lr=1e-2)
    got = train(b, opt, 2, 2)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    dev = off.device_stats()
    assert dev.peak_bytes <= unit and device.peak_bytes <= unit
    assert dev.bytes_to_device > 4 * sum(p.numel() * 4 for p in a.parameters())
    off.close()
    opt.close()
    device.close()


def test_a_cpu_model_takes_the_cpu_path(tmp_path):
    model = TinyLM()
    assert model_device(model) is None
    off = deepnvme.offload_parameters(model, tmp_path, max_in_memory_bytes=1 << 20)
    assert type(off) is deepnvme.ParameterOffload
    off.close()
    with pytest.raises(ValueError, match="max_device_bytes is for a model on a CUDA device"):
        deepnvme.offload_parameters(TinyLM(), tmp_path, max_in_memory_bytes=1 << 20,
                                    max_device_bytes=1 << 20)


def test_models_on_several_devices_or_not_cuda_are_refused():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2, device="meta")
    assert model_device(Two()) is None            # CPU and meta: the CPU path decides
    fake = nn.Linear(2, 2)
    fake.weight = nn.Parameter(torch.empty(2, 2, device="meta"))
    assert model_device(fake) is None


def test_the_update_is_not_fused_on_the_device_path(tmp_path, device):
    """Gradients come back from the device apart from the optimizer's consumer: fuse_backward=True
    is refused, and "auto" (the default) keeps the update after the backward."""
    a, b = make_pair()
    off = offload(b, tmp_path, device)
    try:
        with pytest.raises(ValueError, match="does not hand its gradients"):
            deepnvme.NVMeOptimizer(b.parameters(), torch.optim.SGD, swap_dir=tmp_path / "s",
                                   fuse_backward=True, lr=0.1)
        opt = deepnvme.NVMeOptimizer(b.parameters(), torch.optim.SGD, swap_dir=tmp_path / "s", lr=0.1)
        ref = torch.optim.SGD(a.parameters(), lr=0.1)
        x, y = batches(1)[0]
        for _ in range(3):
            for model, o in ((a, ref), (b, opt)):
                o.zero_grad()
                loss_of(model, x, y).backward()
                o.step()
        assert not opt.fuses_backward
        with torch.no_grad():
            assert torch.equal(a(x), b(x))
        opt.close()
    finally:
        off.close()
