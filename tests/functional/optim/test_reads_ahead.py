"""The update fused into the backward reads each sub-group's state ahead in the order the
previous step updated them (here the sub-groups' own order, not a backward's reverse one),
bitwise as the wrapped optimizer; a write that fails with reads ahead holding buffers still
leaves a buffer for the next install, and nothing is lost."""

import errno

import pytest
import torch

import deepnvme
from deepnvme.optim import NVMeOptimizer
from deepnvme.swap import SwapError

from ...fakes import FullDisk


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(6)])


def train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def watch_installs(opt):
    """(step, sub-group, whether its state was read ahead) of each fused install."""
    reads, seen = opt._fused.reads, []
    installing = reads.installing

    def spy(i):
        seen.append((i, i in reads.ahead))
        installing(i)
    reads.installing = spy
    return seen


def test_the_learned_order_is_read_ahead_bitwise(tmp_path):
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    # parameters in backward order: gradients arrive in the sub-groups' ascending order
    opt = NVMeOptimizer(list(model.parameters())[::-1], torch.optim.AdamW, swap_dir=tmp_path,
                        sub_group_bytes=64 * 64 * 4, buffer_count=8, fuse_backward=True, lr=1e-2)
    try:
        assert opt.num_sub_groups == 6
        seen = watch_installs(opt)
        train(model, opt, 2)            # state created; the order learned
        seen.clear()
        train(model, opt, 2, start=2)
        order = [i for i, _ in seen]
        assert order == list(range(6)) * 2
        assert [hit for _, hit in seen] == ([False] + [True] * 5) * 2
        train(ref, ref_opt, 4)
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    finally:
        opt.close()


def test_a_failed_write_with_reads_ahead_is_kept_and_training_recovers(tmp_path):
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    posix = FullDisk()
    opt = NVMeOptimizer(list(model.parameters())[::-1], torch.optim.AdamW, swap_dir=tmp_path,
                        sub_group_bytes=64 * 64 * 4, fuse_backward=True, lr=1e-2,
                        handle=deepnvme.AioHandle(posix=posix))
    try:
        train(model, opt, 2)
        posix.full.update({"0.swp", "1.swp"})   # the first two updates' writes fail
        with pytest.raises(SwapError, match=r"\[0, 1\] is kept in memory") as info:
            train(model, opt, 1, start=2)
        assert info.value.errno == errno.ENOSPC
        posix.full.clear()
        train(model, opt, 2, start=3)
        train(ref, ref_opt, 5)
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
        assert all(set(st) == {"step"} for st in opt.state.values())   # back on disk
    finally:
        opt.close()
