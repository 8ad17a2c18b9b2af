"""NVMeOptimizer updates a parameter larger than a sub-group in slices: bitwise equal to the
wrapped optimizer updating it whole (SGD, Adam, AdamW; single-tensor, foreach and fused
kernels), with the state buffers bounded by the sub-group; state_dict/load_state_dict see the
whole parameter's state; non-element-wise optimizers keep whole parameters."""

import copy

import pytest
import torch
from torch import nn

import deepnvme
from deepnvme.optim._layout import slice_spans
from deepnvme.optim._slices import is_elementwise

SUB = 16 << 10   # sub-group bytes: the 64 KiB weight below is 4 slices
ENGINE_SPECIFIC = True   # the kernels are under test here, not the I/O engines


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 8))  # 64 KiB, 512 B, ...


def run(opt_factory, steps=3):
    m = model()
    opt = opt_factory(m.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 128, generator=g)
        m(x).pow(2).mean().backward()
        opt.step()
    return m, opt


KERNELS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, foreach=False)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, foreach=True)),
    (torch.optim.Adam, dict(lr=1e-2, fused=True)),
    (torch.optim.AdamW, dict(lr=1e-2, foreach=False)),
    (torch.optim.AdamW, dict(lr=1e-2, foreach=True)),
    (torch.optim.AdamW, dict(lr=1e-2, fused=True, amsgrad=True)),
]


@pytest.mark.parametrize("cls,kw", KERNELS, ids=lambda v: v.__name__ if isinstance(v, type) else
                         "-".join(f"{k}={x}" for k, x in v.items() if k != "lr"))
@pytest.mark.parametrize("threads", [1, 2])
def test_sliced_update_is_bitwise_the_whole_update(tmp_path, cls, kw, threads):
    ref, ref_opt = run(lambda ps: cls(ps, **kw))
    got, opt = run(lambda ps: deepnvme.NVMeOptimizer(ps, cls, swap_dir=tmp_path, sub_group_bytes=SUB,
                                                     update_threads=threads, **kw))
    try:
        assert opt.num_sliced_params == 1 and opt.num_sub_groups == 4 + 1
        for a, b in zip(ref.parameters(), got.parameters()):
            assert torch.equal(a, b)
        sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
        for k, st in ref_sd["state"].items():
            assert st.keys() == sd["state"][k].keys()
            for name, v in st.items():
                w = sd["state"][k][name]
                assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, name
        # between steps only scalar state stays in memory; the step counter once per parameter
        weight = next(got.parameters())
        assert all(v.dim() == 0 for v in opt.state[weight].values() if isinstance(v, torch.Tensor))
        if cls is not torch.optim.SGD:
            assert float(opt.state[weight]["step"]) == 3
    finally:
        opt.close()


def test_state_buffers_bounded_by_the_sub_group_not_the_parameter(tmp_path):
    """A parameter 4x the sub-group trains bitwise with each pinned state buffer one slice's
    state (Adam: 2 x a quarter of the parameter) and at most buffer_count of them in use."""
    ref, _ = run(lambda ps: torch.optim.Adam(ps, lr=1e-2))
    peak = []
    def factory(ps):
        opt = deepnvme.NVMeOptimizer(ps, torch.optim.Adam, swap_dir=tmp_path, sub_group_bytes=SUB,
                                     buffer_count=3, lr=1e-2)
        swapper = opt._state.swapper
        wrapped = opt._wrapped_step
        def watched():
            peak.append(swapper.buffers_in_use())
            wrapped()
        opt._wrapped_step = watched
        return opt
    got, opt = run(factory)
    try:
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), got.parameters()))
        weight_bytes = 128 * 128 * 4
        assert opt.buffer_bytes <= 2 * SUB + 256 < 2 * weight_bytes
        assert max(peak) <= 3
        assert opt.buffer_bytes * max(peak) < 2 * weight_bytes   # the whole state: 128 KiB
    finally:
        opt.close()


def test_load_state_dict_into_sliced_parameters(tmp_path):
    """The whole-parameter state of a plain AdamW run loads into a sliced NVMeOptimizer and
    training goes on bitwise."""
    ref, ref_opt = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2), steps=2)
    sd = copy.deepcopy(ref_opt.state_dict())   # torch's shares the 0-d step tensors
    m = model()
    m.load_state_dict(ref.state_dict())
    opt = deepnvme.NVMeOptimizer(m.parameters(), torch.optim.AdamW, swap_dir=tmp_path,
                                 sub_group_bytes=SUB, lr=1e-2)
    try:
        opt.load_state_dict(sd)
        assert float(opt.state[next(m.parameters())]["step"]) == 2
        g = torch.Generator().manual_seed(5)
        x = torch.randn(16, 128, generator=g)
        for mm, oo in ((ref, ref_opt), (m, opt)):
            oo.zero_grad()
            mm(x).pow(2).mean().backward()
            oo.step()
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), m.parameters()))
    finally:
        opt.close()


class NotElementwise(torch.optim.SGD):
    """A subclass may change the update: not taken as element-wise unless declared."""


class DeclaredElementwise(torch.optim.SGD):
    deepnvme_elementwise = True


def test_elementwise_declaration():
    assert is_elementwise(torch.optim.AdamW) and not is_elementwise(NotElementwise)
    assert is_elementwise(DeclaredElementwise) and not is_elementwise(torch.optim.Adagrad)


def test_non_elementwise_optimizer_keeps_whole_parameters(tmp_path):
    ref, _ = run(lambda ps: NotElementwise(ps, lr=0.1, momentum=0.9))
    got, opt = run(lambda ps: deepnvme.NVMeOptimizer(ps, NotElementwise, swap_dir=tmp_path,
                                                     sub_group_bytes=SUB, lr=0.1, momentum=0.9))
    try:
        assert opt.num_sliced_params == 0 and opt.num_sub_groups == 2
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), got.parameters()))
    finally:
        opt.close()


class RowNorm(torch.optim.Optimizer):
    """Declared element-wise but keeps one value per row: refused with the setting to change."""

    deepnvme_elementwise = True

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    s = self.state[p]
                    if "norm" not in s:
                        s["norm"] = torch.zeros(max(p.numel() // 128, 1))
                    p.add_(p.grad, alpha=-group["lr"])


def test_declared_elementwise_with_other_state_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not element-wise.*sub_group_bytes"):
        run(lambda ps: deepnvme.NVMeOptimizer(ps, RowNorm, swap_dir=tmp_path, sub_group_bytes=SUB))


def test_slice_spans_are_page_multiples():
    assert slice_spans(10_000, 4, 16 << 10) == [(0, 4096), (4096, 8192), (8192, 10_000)]
    assert slice_spans(100, 4, 10) == [(0, 100)]          # at least a page per slice
    assert slice_spans(3000, 2, 4096) == [(0, 2048), (2048, 3000)]
    # the fewest spans, of equal size: two halves rather than 3/4 + 1/4
    assert slice_spans(262144, 4, 786432) == [(0, 131072), (131072, 262144)]
