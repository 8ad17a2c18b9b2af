"""NVMeOptimizer: bitwise equal to the wrapped optimizer in memory, state on disk, failures."""

import contextlib
import errno
import os
import time

import pytest
import torch

import deepnvme
from deepnvme import IOConfig
from deepnvme.io.posix import Posix
from deepnvme.optim import NVMeOptimizer
from deepnvme.swap import SwapError

from ...fakes import FullDisk

OPTIMIZERS = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
]




def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(dtype)


def train(model, opt, steps, start=0, sched=None):
    for step in range(start, start + steps):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step)).to(
            next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


def same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def same_state(sd1, sd2):
    assert sd1["param_groups"] == sd2["param_groups"]
    assert sd1["state"].keys() == sd2["state"].keys()
    for k, st in sd1["state"].items():
        assert st.keys() == sd2["state"][k].keys()
        for name, v in st.items():
            w = sd2["state"][k][name]
            assert (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w), (k, name)
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls,kwargs", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", "") or
                         "-".join(f"{k}" for k in v))
def test_bitwise_equal_to_in_memory(tmp_path, cls, kwargs, dtype):
    ref, off = make_model(dtype), make_model(dtype)
    ref_opt = cls(ref.parameters(), **kwargs)
    with NVMeOptimizer(off.parameters(), cls, swap_dir=tmp_path, sub_group_bytes=8 << 10,
                       **kwargs) as opt:
        assert opt.num_sub_groups > 2
        train(ref, ref_opt, 4)
        train(off, opt, 4)
        assert same_params(ref, off)
        assert same_state(ref_opt.state_dict(), opt.state_dict())


def test_state_lives_on_disk_between_steps(tmp_path):
    model = make_model()
    opt = NVMeOptimizer(model.parameters(), torch.optim.AdamW, swap_dir=tmp_path,
                        sub_group_bytes=8 << 10, lr=1e-3)
    train(model, opt, 2)
    for st in opt.state.values():       # only Adam's 0-d 'step' stays in memory
        assert set(st) == {"step"} and st["step"].dim() == 0
    files = [f for f in os.listdir(opt.swap_directory) if f.endswith(".swp")]
    assert len(files) == opt.num_sub_groups
    state_bytes = 2 * 4 * sum(p.numel() for p in model.parameters())
    on_disk = sum(os.path.getsize(os.path.join(opt.swap_directory, f)) for f in files)
    assert state_bytes <= on_disk < state_bytes + 64 * 2 * len(list(model.parameters()))
    assert opt.swapped_bytes == on_disk and opt.buffer_bytes >= max(
        os.path.getsize(os.path.join(opt.swap_directory, f)) for f in files)
    assert opt._state.swapper.buffers_in_use() == 0
    d = opt.swap_directory
    opt.close()
    assert not os.path.exists(d)


def test_param_groups_scheduler_zero_grad_and_frozen_params(tmp_path):
    def setup(make):
        m = make_model()
        m[2].weight.requires_grad_(False)  # never gets a grad: no state
        groups = [{"params": list(m[0].parameters()), "lr": 0.01},
                  {"params": list(m[2].parameters()) + list(m[4].parameters()), "lr": 0.05,
                   "weight_decay": 0.0}]
        opt = make(groups)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return m, opt, sched

    m1, o1, s1 = setup(lambda g: torch.optim.AdamW(g, weight_decay=0.1))
    m2, o2, s2 = setup(lambda g: NVMeOptimizer(g, torch.optim.AdamW, swap_dir=tmp_path,
                                               sub_group_bytes=4 << 10, weight_decay=0.1))
    train(m1, o1, 5, sched=s1)
    train(m2, o2, 5, sched=s2)
    assert same_params(m1, m2)
    assert [g["lr"] for g in o2.param_groups] == [g["lr"] for g in o1.param_groups] == [0.0025, 0.0125]
    assert same_state(o1.state_dict(), o2.state_dict())
    o2.zero_grad()
    assert all(p.grad is None for p in m2.parameters())
    o2.zero_grad(set_to_none=False)
    calls = []
    o2.register_step_post_hook(lambda opt, args, kwargs: calls.append(opt))
    m2(torch.ones(1, 32)).sum().backward()
    o2.step()
    assert calls == [o2]
    o2.close()


def test_checkpoint_and_resume_equals_uninterrupted(tmp_path):
    full, resumed = make_model(), make_model()
    full_opt = NVMeOptimizer(full.parameters(), swap_dir=tmp_path / "a", sub_group_bytes=8 << 10, lr=1e-2)
    train(full, full_opt, 6)

    opt = NVMeOptimizer(resumed.parameters(), swap_dir=tmp_path / "b", sub_group_bytes=8 << 10, lr=1e-2)
    train(resumed, opt, 3)
    torch.save({"model": resumed.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt.pt")
    opt.close()

    model = make_model()
    ckpt = torch.load(tmp_path / "ckpt.pt")
    model.load_state_dict(ckpt["model"])
    opt = NVMeOptimizer(model.parameters(), swap_dir=tmp_path / "c", sub_group_bytes=8 << 10, lr=1e-2)
    opt.load_state_dict(ckpt["optim"])
    assert all(set(st) == {"step"} for st in opt.state.values())  # the loaded state went to disk
    train(model, opt, 3, start=3)
    assert same_params(full, model)
    assert same_state(full_opt.state_dict(), opt.state_dict())
    # a plain in-memory AdamW loads the same checkpoint
    plain = torch.optim.AdamW(make_model().parameters(), lr=1e-2)
    plain.load_state_dict(ckpt["optim"])
    full_opt.close()
    opt.close()


def test_full_disk_keeps_state_in_memory_and_recovers(tmp_path):
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    posix = FullDisk()
    opt = NVMeOptimizer(model.parameters(), swap_dir=tmp_path, sub_group_bytes=8 << 10, lr=1e-2,
                        handle=deepnvme.AioHandle(posix=posix))
    n = opt.num_sub_groups
    train(ref, ref_opt, 2)
    train(model, opt, 1)
    posix.full.add(f"{n - 1}.swp")       # the last sub-group's write fails: ENOSPC
    expected = rf"sub-groups 0..{n - 1} of {n} were updated.*\[{n - 1}\] is kept in memory"
    with pytest.raises(SwapError, match=expected) as info:
        train(model, opt, 1, start=1)
    assert info.value.errno == errno.ENOSPC
    assert same_params(ref, model)
    assert same_state(ref_opt.state_dict(), opt.state_dict())   # nothing lost
    posix.full.clear()                    # space again: training goes on, still exact
    train(ref, ref_opt, 2, start=2)
    train(model, opt, 2, start=2)
    assert same_params(ref, model)
    assert all(set(st) == {"step"} for st in opt.state.values())
    opt.close()


def test_vanished_swap_dir_is_a_clear_error(tmp_path):
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = NVMeOptimizer(model.parameters(), torch.optim.SGD, swap_dir=tmp_path,
                        sub_group_bytes=8 << 10, lr=0.1, momentum=0.9)
    train(ref, ref_opt, 1)
    train(model, opt, 1)
    deepnvme.swap._dirs.remove_dir(opt.swap_directory)
    with pytest.raises(SwapError, match="vanished.*no sub-group was updated"):
        train(model, opt, 1, start=1)
    assert same_params(ref, model)           # the failed step changed nothing
    assert opt._state.swapper.buffers_in_use() == 0
    opt.close()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="buffer_count"):
        NVMeOptimizer(make_model().parameters(), swap_dir=tmp_path, buffer_count=1)
    assert isinstance(NVMeOptimizer(make_model().parameters(), swap_dir=tmp_path), torch.optim.Optimizer)
    with pytest.raises(ValueError, match="CPU parameters.*on meta"):
        NVMeOptimizer([torch.nn.Parameter(torch.empty(4, device="meta"))], swap_dir=tmp_path)


def test_an_optimizer_or_a_model_in_place_of_params_says_what_to_pass(tmp_path):
    model = make_model()
    swap = tmp_path / "swap"
    with pytest.raises(TypeError, match=r"builds the optimizer itself.*NVMeOptimizer\(model\."
                                        r"parameters\(\), torch\.optim\.AdamW.*not an optimizer object \(got AdamW"):
        NVMeOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), swap_dir=swap)
    with pytest.raises(TypeError, match=r"optimizer_cls must be an optimizer class.*"
                                        r"not an optimizer object \(got SGD\)"):
        NVMeOptimizer(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), swap_dir=swap)
    with pytest.raises(TypeError, match=r"the model's parameters, not the Sequential module"):
        NVMeOptimizer(model, swap_dir=swap)
    with pytest.raises(TypeError, match=r"optimizer_cls must be an optimizer class.*got str"):
        NVMeOptimizer(model.parameters(), "adamw", swap_dir=swap)
    assert not swap.exists()                 # refused before anything was created
    # what the message suggests works, and carries the options over
    inner = torch.optim.AdamW(model.parameters(), lr=5e-3)
    with NVMeOptimizer(inner.param_groups, type(inner), swap_dir=swap) as opt:
        assert opt.param_groups[0]["lr"] == 5e-3


def test_close_removes_the_swap_dir_it_created_and_only_that(tmp_path):
    swap = tmp_path / "runs" / "swap"
    model = make_model()
    opt = NVMeOptimizer(model.parameters(), swap_dir=swap, sub_group_bytes=8 << 10)
    train(model, opt, 1)
    assert os.listdir(opt.swap_directory) and os.path.dirname(opt.swap_directory) == str(swap)
    opt.close()
    assert os.listdir(tmp_path) == []        # both levels it created, once empty
    (tmp_path / "mine").mkdir()
    opt = NVMeOptimizer(make_model().parameters(), swap_dir=tmp_path / "mine")
    opt.close()
    assert (tmp_path / "mine").is_dir()      # it existed before: kept
    opt = NVMeOptimizer(make_model().parameters(), swap_dir=tmp_path / "made")
    (tmp_path / "made" / "notes.txt").write_text("the user's")
    opt.close()
    assert os.listdir(tmp_path / "made") == ["notes.txt"]   # not empty: kept


class SlowDisk(Posix):
    """Every transfer takes ``delay`` seconds more (a sleep, which releases the GIL)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def preadv(self, fd, buffers, offset):
        if offset == 0:
            time.sleep(self.delay)
        return super().preadv(fd, buffers, offset)

    def pwritev(self, fd, buffers, offset):
        if offset == 0:
            time.sleep(self.delay)
        return super().pwritev(fd, buffers, offset)


class SlowAdamW(torch.optim.AdamW):
    delay = 0.0

    def step(self, closure=None):
        time.sleep(self.delay)
        return super().step(closure)


def test_pipeline_overlaps_read_update_and_write(tmp_path):
    """Serially a step would take n x (read + update + write); the pipeline hides two of them."""
    d = 0.04
    params = [torch.nn.Parameter(torch.randn(1024)) for _ in range(10)]
    opt = NVMeOptimizer(params, SlowAdamW, swap_dir=tmp_path, sub_group_bytes=4096, lr=1e-3,
                        handle=deepnvme.AioHandle(intra_op_parallelism=2, posix=SlowDisk(d)))
    n = opt.num_sub_groups

    def step():
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()

    step()
    SlowAdamW.delay = d
    try:
        t0 = time.perf_counter()
        step()
        step()
        per_step = (time.perf_counter() - t0) / 2
    finally:
        SlowAdamW.delay = 0.0
    serial = 3 * n * d
    assert n == 10 and per_step < 0.65 * serial, (per_step, serial)
    opt.close()


@contextlib.contextmanager
def torch_threads(n):
    """torch's intra-op thread count set to ``n`` for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class ThreadsSeen(torch.optim.AdamW):
    """AdamW that records torch's thread count at each step (and can fail once)."""

    def __init__(self, *a, fail=False, **kw):
        super().__init__(*a, **kw)
        self.seen, self.fail = [], fail

    def step(self, closure=None):
        self.seen.append(torch.get_num_threads())
        if self.fail:
            raise RuntimeError("update failed")
        return super().step(closure)


@pytest.mark.parametrize("cls,kwargs", [(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
                                        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})])
def test_update_threads_run_the_update_with_that_many_threads_bitwise_the_same(tmp_path, cls,
                                                                                 kwargs):
    """Elementwise updates of tensors large enough for torch to split across threads."""
    with torch_threads(2):
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.Linear(512, 512))
        off = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.Linear(512, 512))
        off.load_state_dict(ref.state_dict())
        with NVMeOptimizer(off.parameters(), cls, swap_dir=tmp_path, update_threads=1,
                           sub_group_bytes=1 << 20, **kwargs) as opt:
            train(ref, cls(ref.parameters(), **kwargs), 3)
            train(off, opt, 3)
            assert same_params(ref, off) and torch.get_num_threads() == 2


def test_update_threads_are_set_for_the_update_and_restored_after_a_failure(tmp_path):
    with torch_threads(2):
        model = make_model()
        with NVMeOptimizer(model.parameters(), ThreadsSeen, swap_dir=tmp_path, update_threads=1,
                           sub_group_bytes=8 << 10, lr=1e-3) as opt:
            train(model, opt, 1)
            assert opt.optimizer.seen == [1] * opt.num_sub_groups
            opt.optimizer.fail = True
            with pytest.raises(RuntimeError, match="update failed"):
                train(model, opt, 1)
            assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="update_threads"):
            NVMeOptimizer(model.parameters(), swap_dir=tmp_path, update_threads=0)


def test_auto_update_threads_leave_cores_to_the_io_for_elementwise_optimizers_only(tmp_path):
    with torch_threads(6):
        model = make_model()
        config = IOConfig(intra_op_parallelism=2)
        with NVMeOptimizer(model.parameters(), torch.optim.AdamW, swap_dir=tmp_path / "a",
                           config=config, lr=1e-3) as opt:
            assert opt.update_threads == 4   # 6 torch threads less 2 I/O threads
        with NVMeOptimizer(model.parameters(), torch.optim.SGD, swap_dir=tmp_path / "b",
                           config=IOConfig(intra_op_parallelism=8), lr=1e-3) as opt:
            assert opt.update_threads == 1   # never below one
        with NVMeOptimizer(model.parameters(), ThreadsSeen, swap_dir=tmp_path / "c", lr=1e-3) as opt:
            assert opt.update_threads is None   # not known to be elementwise: the caller's threads
            train(model, opt, 1)
            assert set(opt.optimizer.seen) == {6}
        with NVMeOptimizer(model.parameters(), torch.optim.AdamW, swap_dir=tmp_path / "d",
                           update_threads=None, lr=1e-3) as opt:
            assert opt.update_threads is None
        with pytest.raises(ValueError, match="update_threads must be an int >= 1, 'auto' or None"):
            NVMeOptimizer(model.parameters(), swap_dir=tmp_path / "e", update_threads="some")
