"""Parameter offload of a model on a CUDA device. Skipped without CUDA.

The model trains on the GPU with its master parameters in files: each module's parameters are
read into page-locked memory and copied to the device on a side stream ahead of use, gradients
come back the same way, and NVMeOptimizer updates the master copy on the CPU. The reference is
the same model trained on the GPU with fp32 master copies on the CPU updated by the same torch
optimizer (gradients copied to the CPU, the update copied back): the same kernels on the same
values, so the two must agree bitwise. DeepSpeed's storage-guide config (``use_gds: true``) is
accepted, with ``aio.use_gds`` named in the one warning.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import deepnvme
from deepnvme.offload._device_offload import DeviceParameterOffload

from ..unit.offload.test_deepspeed_config import GUIDE

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DIM = 256


class Net(nn.Module):
    """Linear layers, layer norms and GELUs (deterministic kernels on CUDA), one module twice."""

    def __init__(self, layers: int = 4, dim: int = DIM) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim),
                                                  nn.GELU(), nn.Linear(4 * dim, dim))
                                    for _ in range(layers))
        self.out = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        h = h + self.blocks[0](h)
        return self.out(h)


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, DIM, generator=g).cuda(), torch.randint(0, 8, (16,), generator=g).cuda())
            for _ in range(n)]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


class CpuMasterReference:
    """A plain CUDA model whose update runs on fp32 CPU master copies (ZeRO-Offload's maths)."""

    def __init__(self, model: nn.Module, opt_cls, **kwargs) -> None:
        self.model = model
        self.masters = [p.detach().cpu().clone().requires_grad_() for p in model.parameters()]
        self.opt = opt_cls(self.masters, **kwargs)

    def zero_grad(self) -> None:
        self.opt.zero_grad()
        self.model.zero_grad(set_to_none=True)

    def step(self) -> None:
        for m, p in zip(self.masters, self.model.parameters()):
            m.grad = None if p.grad is None else p.grad.cpu()
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.model.parameters()):
                p.copy_(m)


def train(model, opt, steps: int, accum: int) -> list[torch.Tensor]:
    data = iter(batches(steps * accum))
    probe = batches(1, seed=11)[0][0]
    outputs = []
    for _ in range(steps):
        opt.zero_grad()
        for micro in range(accum):
            loss_of(model, *next(data)).backward()
            if micro == 0:
                with torch.no_grad():
                    outputs.append(model(probe).cpu())
        opt.step()
        with torch.no_grad():
            outputs.append(model(probe).cpu())
    return outputs


def diff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"max |diff| {(a.float() - b.float()).abs().max().item():.3e}"


# max_device_bytes: the default, or one unit (the largest: a 256 x 1024 Linear), so that every
# copy evicts another; min_offload None keeps biases and norms on the device for good
@pytest.mark.parametrize("accum,min_offload,max_device", [(1, 0, None), (2, None, None),
                                                         (2, 0, (256 * 1024 + 1024) * 4),
                                                         (1, None, (256 * 1024 + 1024) * 4)])
def test_training_on_cuda_with_offloaded_parameters_equals_the_reference_bitwise(
        tmp_path, accum, min_offload, max_device):
    torch.manual_seed(0)
    a = Net().cuda()
    b = copy.deepcopy(a)
    expected = train(a, CpuMasterReference(a, torch.optim.AdamW, lr=1e-3, weight_decay=0.1), 3, accum)
    off = deepnvme.offload_parameters(b, tmp_path, max_in_memory_bytes=8 << 20, prefetch=2,
                                      min_offload_bytes=min_offload, max_device_bytes=max_device)
    assert isinstance(off, DeviceParameterOffload)
    assert all(p.is_cuda for p in b.parameters())
    opt = deepnvme.NVMeOptimizer(b.parameters(), torch.optim.AdamW, swap_dir=tmp_path,
                                 sub_group_bytes=2 << 20, lr=1e-3, weight_decay=0.1)
    got = train(b, opt, 3, accum)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert torch.equal(e, g), f"output {i}: {diff(e, g)}"
    state = off.state_dict()
    for name, value in a.state_dict().items():
        assert torch.equal(value.cpu(), state[name].cpu()), f"{name}: {diff(value.cpu(), state[name].cpu())}"
    dev = off.device_stats()
    assert dev.peak_bytes <= dev.budget_bytes and dev.bytes_to_host > 0
    off.close()
    opt.close()


def test_device_memory_of_parameters_stays_within_the_budget(tmp_path):
    layers, dim = 16, 1024
    model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers))).cuda()
    unit = (dim * dim + dim) * 4
    full = layers * unit
    torch.cuda.synchronize()
    off = deepnvme.offload_parameters(model, tmp_path, max_in_memory_bytes=8 * unit, prefetch=1,
                                      max_device_bytes=3 * unit)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    x = torch.randn(64, dim, device="cuda")
    for _ in range(2):
        model(x).sum().backward()
        off.zero_grad()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    activations = layers * 64 * dim * 4 * 2
    # parameter copies + gradients in flight back (two units) and the one autograd is producing
    # + activations: well below the model
    assert off.device_stats().peak_bytes <= 3 * unit
    assert peak <= 3 * unit + 3 * unit + activations + (8 << 20), (peak, full)
    assert peak < full
    off.close()


def test_copies_are_issued_ahead_of_the_modules_that_need_them(tmp_path):
    layers, dim = 8, 1024
    model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers))).cuda()
    # host memory for the whole model (and gradients): the reads have landed when the prefetch
    # looks, so the copies of the next two units are issued before this one runs
    off = deepnvme.offload_parameters(model, tmp_path, max_in_memory_bytes=128 << 20, prefetch=2)
    seen: dict[int, set[str]] = {}

    def record(i):
        def hook(module, args):   # after the offload's own pre-hook
            seen[i] = {c.entry.name for c in off._copies.present.values()}
        return hook
    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(record(i))
    x = torch.randn(32, dim, device="cuda")
    for _ in range(3):
        model(x).sum().backward()
    for i in range(layers - 2):
        assert {f"{i + 1}.weight", f"{i + 2}.weight"} <= seen[i], (i, sorted(seen[i]))
    assert off.device_stats().prefetch_hits >= 2 * (layers - 2)
    off.close()


def test_nvme_optimizer_refuses_cuda_parameters_that_are_not_offloaded(tmp_path):
    model = nn.Linear(8, 8).cuda()
    with pytest.raises(ValueError, match=r"NVMeOptimizer needs CPU parameters"):
        deepnvme.NVMeOptimizer(model.parameters(), torch.optim.SGD, swap_dir=tmp_path, lr=0.1)


def test_the_storage_guide_example_is_accepted_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = deepnvme.from_deepspeed_config(GUIDE)
    assert len(caught) == 1 and "aio.use_gds" in str(caught[0].message)
    assert settings.param is not None and settings.optimizer is not None
