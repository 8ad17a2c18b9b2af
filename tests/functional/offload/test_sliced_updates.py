"""An offloaded parameter larger than an optimizer sub-group is updated in slices read from its
file (with its gradient's), bitwise as in memory, within the budget: a 256 KiB weight under a
256 KiB budget (sub-groups of a quarter of it) trains with AdamW and SGD, gradients on NVMe or
kept in memory, with gradient accumulation; the whole parameter is never in memory for its
update, and a non-element-wise optimizer still gets the clear refusal."""

import copy

import pytest
import torch
from torch import nn

import deepnvme
from deepnvme.offload import offload_parameters

BIG = 256 * 256 * 4


def models():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Tanh(), nn.Linear(256, 4))
    return a, copy.deepcopy(a)


@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                                    (torch.optim.SGD, dict(lr=0.1, momentum=0.9))],
                         ids=["AdamW", "SGD"])
@pytest.mark.parametrize("offload_gradients", [True, False], ids=["grads-nvme", "grads-memory"])
@pytest.mark.parametrize("accum", [1, 2])
def test_sliced_update_of_an_offloaded_parameter_is_bitwise(tmp_path, cls, kw, offload_gradients, accum):
    """Accumulating a gradient on NVMe needs it twice in memory (stored + autograd's): a budget
    of 2x, which also fits the whole update: the weight is then read and written whole (as it
    is with its gradient kept in memory: the update needs only the weight's room), its state
    still slice by slice."""
    ref_model, model = models()
    config = deepnvme.IOConfig(block_size=16 << 10)
    budget = 2 * BIG if accum == 2 and offload_gradients else BIG
    off = offload_parameters(model, tmp_path / "p", max_in_memory_bytes=budget, config=config,
                             offload_gradients=offload_gradients)
    opt = deepnvme.NVMeOptimizer(model.parameters(), cls, swap_dir=tmp_path / "s", **kw)
    ref = cls(ref_model.parameters(), **kw)
    try:
        assert opt.sub_group_bytes == budget // 4 and opt.num_sliced_params == 1
        g = torch.Generator().manual_seed(3)
        data = [torch.randn(5, 256, generator=g) for _ in range(3 * accum)]
        update_peak = 0
        for step in range(3):
            for m, o in ((ref_model, ref), (model, opt)):
                o.zero_grad()
                for x in data[accum * step:accum * (step + 1)]:
                    m(x).pow(2).sum().backward()
                off.reset_stats()
                o.step()
                update_peak = max(update_peak, off.stats().peak_bytes)
        got = off.state_dict()
        for name, value in ref_model.state_dict().items():
            assert torch.equal(value, got[name]), name
        # the update within the budget (the backward may hold one more gradient from autograd)
        assert update_peak <= budget
    finally:
        opt.close()
        off.close()


def test_slices_read_and_write_a_quarter_at_a_time(tmp_path):
    """The update moves the weight's bytes in slices: each read and write of it is one slice."""
    _, model = models()
    off = offload_parameters(model, tmp_path / "p", max_in_memory_bytes=BIG)
    opt = deepnvme.NVMeOptimizer(model.parameters(), torch.optim.SGD, swap_dir=tmp_path / "s", lr=0.1)
    moved = []
    swapper = off._store.swapper
    for name in ("swap_in_range", "swap_out_range"):
        real = getattr(swapper, name)
        def spy(key, t, offset, real=real, name=name):
            moved.append((name, key, offset, t.numel() * t.element_size()))
            return real(key, t, offset)
        setattr(swapper, name, spy)
    try:
        model(torch.randn(2, 256)).sum().backward()
        opt.step()
        assert {size for *_, size in moved} == {BIG // 4}
        reads = {(key, offset) for name, key, offset, _ in moved if name == "swap_in_range"}
        writes = [(key, offset) for name, key, offset, _ in moved if name == "swap_out_range"]
        assert len(reads) == 8 and len(writes) == 4   # data and gradient read, data written
    finally:
        opt.close()
        off.close()


def test_non_elementwise_optimizer_still_needs_the_whole_parameter(tmp_path):
    _, model = models()
    off = offload_parameters(model, tmp_path / "p", max_in_memory_bytes=BIG)
    try:
        with pytest.raises(deepnvme.OffloadMemoryError,
                           match=r"parameter 0.weight needs 524288 bytes in memory for its "
                                 r"optimizer update"):
            deepnvme.NVMeOptimizer(model.parameters(), torch.optim.Adagrad, swap_dir=tmp_path / "s")
    finally:
        off.close()


def test_a_parameter_whose_update_fits_is_moved_whole_and_its_state_in_slices(tmp_path):
    """Budget 4x the weight: the weight and its gradient are read whole (no range I/O) while
    the optimizer's state buffers hold one slice's state, not the weight's."""
    ref_model, model = models()
    off = offload_parameters(model, tmp_path / "p", max_in_memory_bytes=4 * BIG)
    opt = deepnvme.NVMeOptimizer(model.parameters(), torch.optim.AdamW, swap_dir=tmp_path / "s",
                                 sub_group_bytes=BIG // 4, lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    ranges = []
    swapper = off._store.swapper
    real = swapper.swap_in_range
    swapper.swap_in_range = lambda *a: ranges.append(a) or real(*a)
    try:
        assert opt.num_sliced_params == 1 and opt.buffer_bytes < 2 * BIG // 2
        x = torch.randn(5, 256)
        for m, o in ((ref_model, ref), (model, opt)):
            for _ in range(2):
                o.zero_grad()
                m(x).pow(2).sum().backward()
                o.step()
        got = off.state_dict()
        assert all(torch.equal(v, got[k]) for k, v in ref_model.state_dict().items())
        assert ranges == []
    finally:
        opt.close()
        off.close()
