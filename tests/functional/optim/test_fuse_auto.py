"""fuse_backward="auto" (the default): the first step with gradients runs unfused and is watched;
fusing starts only after a clean step (one gradient per parameter, unchanged before step(), one
process), bitwise as the unfused update. Once fused, a consumed gradient raises on any use until
step(), and zero_grad() after fused updates or a hand-set gradient at step() raise."""


import pytest
import torch
from torch import nn

import deepnvme
from deepnvme.offload import offload_parameters
from deepnvme.optim import _fuse_auto
from deepnvme.optim._fuse_auto import ConsumedGradient, StepObserver

from ..offload.test_fused_backward import BIG, models


def loop(model, opt, steps=3, micro=1, clip=None, scale=None, g=None):
    g = g if g is not None else torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(micro):
            model(torch.randn(5, 256, generator=g)).pow(2).sum().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scale is not None:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = p.grad * scale
        opt.step()


def build(tmp_path, model, where, **kw):
    off = None
    if where == "offload":
        off = offload_parameters(model, tmp_path / "p", max_in_memory_bytes=4 * BIG)
    kw.setdefault("sub_group_bytes", BIG // 4)
    opt = deepnvme.NVMeOptimizer(model.parameters(), torch.optim.AdamW, swap_dir=tmp_path / "s",
                                 lr=1e-2, weight_decay=0.1, **kw)
    return off, opt


def close(off, opt):
    opt.close()
    if off is not None:
        off.close()


def weights(model, off):
    return off.state_dict() if off is not None else model.state_dict()


@pytest.mark.parametrize("where", ["memory", "offload"])
def test_auto_fuses_after_a_clean_first_step_bitwise(tmp_path, where):
    ref, model = models()
    off, opt = build(tmp_path, model, where)
    try:
        assert not opt.fuses_backward
        loop(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), steps=4)
        g = torch.Generator().manual_seed(3)
        loop(model, opt, steps=1, g=g)
        assert opt.fuses_backward                     # learned from the first step
        if off is not None:
            off.reset_stats()
        loop(model, opt, steps=3, g=g)
        got = weights(model, off)
        for name, value in ref.state_dict().items():
            assert torch.equal(value, got[name]), name
        assert all(p.grad is None for p in model.parameters())   # stand-ins cleared by step()
        if off is not None:   # fused: no gradient written, each parameter written by its update
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            assert off.stats().bytes_written <= 3 * params
    finally:
        close(off, opt)


# offloaded gradients are not in .grad: for them only accumulation is observable
@pytest.mark.parametrize("where,case", [("memory", "accumulation"), ("memory", "clipping"),
                                        ("memory", "replaced"), ("offload", "accumulation")])
def test_auto_stays_unfused_for_loops_that_need_the_gradients(tmp_path, where, case, caplog):
    kw = {"accumulation": dict(micro=2), "clipping": dict(clip=0.01),
          "replaced": dict(scale=0.5)}[case]
    ref, model = models()
    off, opt = build(tmp_path, model, where)
    try:
        loop(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), steps=3, **kw)
        with caplog.at_level("INFO", logger="deepnvme.optim.nvme_optimizer"):
            loop(model, opt, steps=3, **kw)
        assert not opt.fuses_backward
        assert {"accumulation": "gradient accumulation", "clipping": "was changed",
                "replaced": "was changed"}[case] in caplog.text
        got = weights(model, off)
        for name, value in ref.state_dict().items():
            assert torch.equal(value, got[name]), name
    finally:
        close(off, opt)


def test_auto_waits_for_a_step_with_gradients(tmp_path):
    _, model = models()
    off, opt = build(tmp_path, model, "memory")
    try:
        opt.step()                      # no backward yet: nothing learned
        assert not opt.fuses_backward and opt._observer is not None
        loop(model, opt, steps=1)
        assert opt.fuses_backward
    finally:
        close(off, opt)


def test_auto_does_not_fuse_in_a_multi_rank_job(tmp_path, monkeypatch):
    _, model = models()
    off, opt = build(tmp_path, model, "memory")
    try:
        monkeypatch.setattr(_fuse_auto, "multi_rank", lambda: True)
        loop(model, opt, steps=2)
        assert not opt.fuses_backward
    finally:
        close(off, opt)


@pytest.mark.parametrize("where", ["memory", "offload"])
@pytest.mark.parametrize("fuse", [True, "auto"])
def test_clipping_a_consumed_gradient_raises(tmp_path, where, fuse):
    _, model = models()
    off, opt = build(tmp_path, model, where, fuse_backward=fuse)
    try:
        if fuse == "auto":
            loop(model, opt, steps=1)
        assert opt.fuses_backward
        opt.zero_grad()
        model(torch.randn(5, 256)).pow(2).sum().backward()
        grads = [p.grad for p in model.parameters()]
        assert all(isinstance(g, ConsumedGradient) for g in grads)
        assert "ConsumedGradient(shape=" in repr(grads[0])
        with pytest.raises(RuntimeError, match="clipped.*fuse_backward=False"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(RuntimeError, match=r"shape \[4\].*gone"):
            grads[-1].sum()
        del grads
        opt.step()
        assert all(p.grad is None for p in model.parameters())
    finally:
        close(off, opt)


def test_zero_grad_after_fused_updates_raises(tmp_path):
    _, model = models()
    off, opt = build(tmp_path, model, "memory", fuse_backward=True)
    try:
        opt.zero_grad()                 # nothing updated yet: fine
        model(torch.randn(5, 256)).pow(2).sum().backward()
        with pytest.raises(RuntimeError, match="already updated.*fuse_backward=False"):
            opt.zero_grad()
        opt.step()
        opt.zero_grad()
    finally:
        close(off, opt)


def test_a_gradient_set_by_hand_at_step_raises(tmp_path):
    _, model = models()
    off, opt = build(tmp_path, model, "memory", fuse_backward=True)
    try:
        model[4](torch.randn(5, 32)).sum().backward()   # the last layer's gradients: hooks
        p = next(model.parameters())
        p.grad = torch.ones_like(p)                      # and one by hand: it would be skipped
        with pytest.raises(RuntimeError, match="did not come through the backward"):
            opt.step()
    finally:
        close(off, opt)


def test_bad_fuse_backward_value(tmp_path):
    _, model = models()
    with pytest.raises(ValueError, match="fuse_backward must be"):
        deepnvme.NVMeOptimizer(model.parameters(), swap_dir=tmp_path, fuse_backward="yes")


def test_observer_verdicts():
    p = nn.Parameter(torch.ones(3))
    groups = [{"params": [p], "lr": 0.1, "lr_t": torch.tensor(0.1)}]
    obs = StepObserver([p], groups)
    assert obs.verdict() == ""                      # no gradient yet
    (p * 2).sum().backward()
    assert obs.verdict() is None                    # one gradient, untouched
    groups[0]["lr_t"].fill_(0.2)                    # a tensor option changed in place
    assert "options" in obs.verdict()
    groups[0]["lr_t"] = torch.tensor(0.1)
    obs.reset()
    p.grad = None
    (p * 2).sum().backward()
    assert obs.verdict() is None
    p.grad.mul_(0.5)
    assert "changed" in obs.verdict()
    obs.reset()
    p.grad = None
    (p * 2).sum().backward()
    (p * 2).sum().backward()
    assert "2 gradients" in obs.verdict()
    obs.remove()
    p.grad = None
    (p * 2).sum().backward()
    assert obs.verdict() == ""                      # hooks removed


def test_auto_stays_unfused_when_a_forward_runs_between_backward_and_step(tmp_path, caplog):
    ref, model = models()
    off, opt = build(tmp_path, model, "offload")
    probe = torch.randn(2, 256)
    try:
        outs = {}
        for m, o in ((ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)),
                     (model, opt)):
            g, outs[id(m)] = torch.Generator().manual_seed(3), []
            for _ in range(3):
                o.zero_grad()
                m(torch.randn(5, 256, generator=g)).pow(2).sum().backward()
                with torch.no_grad():
                    outs[id(m)].append(m(probe))   # sees the parameters before the update
                with caplog.at_level("INFO", logger="deepnvme.optim.nvme_optimizer"):
                    o.step()
        assert not opt.fuses_backward and "forward ran between" in caplog.text
        assert all(torch.equal(a, b) for a, b in zip(outs[id(ref)], outs[id(model)]))
    finally:
        close(off, opt)


@pytest.mark.parametrize("where", ["memory", "offload"])
def test_a_forward_with_an_updated_parameter_before_step_raises(tmp_path, where):
    _, model = models()
    off, opt = build(tmp_path, model, where, fuse_backward=True)
    try:
        model(torch.randn(5, 256)).pow(2).sum().backward()
        with torch.no_grad(), pytest.raises(RuntimeError, match="forward ran between.*fuse_backward=False"):
            model(torch.randn(2, 256))
        opt.step()
        with torch.no_grad():
            model(torch.randn(2, 256))             # after step(): fine
    finally:
        close(off, opt)


def test_a_step_without_a_backward_runs_unfused_with_the_gradients_present(tmp_path):
    ref, model = models()
    off, opt = build(tmp_path, model, "memory", fuse_backward=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    try:
        for m, o in ((ref, ref_opt), (model, opt)):
            for p in m.parameters():
                p.grad = torch.full_like(p, 0.5)
            o.step()
            o.step()                                # the same gradients again, as torch does
        for name, value in ref.state_dict().items():
            assert torch.equal(value, model.state_dict()[name]), name
    finally:
        close(off, opt)



def test_auto_stays_unfused_when_the_lr_changes_between_backward_and_step(tmp_path, caplog):
    ref, model = models()
    off, opt = build(tmp_path, model, "memory")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    try:
        for m, o in ((ref, ref_opt), (model, opt)):
            g = torch.Generator().manual_seed(3)
            for step in range(3):
                o.zero_grad()
                m(torch.randn(5, 256, generator=g)).pow(2).sum().backward()
                for group in o.param_groups:
                    group["lr"] = 1e-2 / (step + 2)     # warm-up code placed before step()
                with caplog.at_level("INFO", logger="deepnvme.optim.nvme_optimizer"):
                    o.step()
        assert not opt.fuses_backward and "options (lr, ...) changed" in caplog.text
        for name, value in ref.state_dict().items():
            assert torch.equal(value, model.state_dict()[name]), name
    finally:
        close(off, opt)


def test_a_fused_step_whose_lr_changed_after_the_backward_raises(tmp_path):
    _, model = models()
    off, opt = build(tmp_path, model, "offload", fuse_backward=True)
    try:
        model(torch.randn(5, 256)).pow(2).sum().backward()
        opt.param_groups[0]["lr"] = 0.5
        with pytest.raises(RuntimeError, match=r"options \(lr, ...\) changed.*fuse_backward=False"):
            opt.step()
    finally:
        close(off, opt)


def test_a_pending_gradient_is_a_stand_in_too(tmp_path):
    """A gradient kept until its sub-group is complete is marked at once, so clipping every
    parameter's gradient fails even before any update ran."""
    _, model = models()
    off, opt = build(tmp_path, model, "memory", fuse_backward=True, sub_group_bytes=1 << 30)
    try:
        out = model[4](torch.randn(5, 32)).sum()      # only the last layer: its sub-group waits
        out.backward()
        assert opt._fused.pending and not opt._fused.updated
        assert isinstance(model[4].weight.grad, ConsumedGradient)
        with pytest.raises(RuntimeError, match="clipped"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        assert model[4].weight.grad is None
    finally:
        close(off, opt)
