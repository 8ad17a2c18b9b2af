"""NVMeOptimizer regressions: failed writes during a pipelined step, buffer bounds, add_param_group."""

import errno
import os
import time

import pytest
import torch

import deepnvme
from deepnvme.io.posix import Posix
from deepnvme.optim import NVMeOptimizer
from deepnvme.swap import SwapError

from ...concurrency import call_in_thread


class SlowFullDisk(Posix):
    """With ``fail`` set, every write sleeps 0.1 s (so reads wait on pending releases) then fails."""

    fail = False

    def pwritev(self, fd, buffers, offset):
        if self.fail:
            time.sleep(0.1)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwritev(fd, buffers, offset)


@pytest.mark.parametrize("buffer_count,layers", [(2, 4), (3, 8)])
def test_step_raises_the_write_failure_instead_of_hanging(tmp_path, buffer_count, layers):
    disk = SlowFullDisk()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)])
    opt = NVMeOptimizer(model.parameters(), torch.optim.Adam, swap_dir=tmp_path, sub_group_bytes=5000,
                        buffer_count=buffer_count, handle=deepnvme.AioHandle(posix=disk))
    assert opt.num_sub_groups == layers
    model(torch.randn(2, 32)).sum().backward()
    opt.step()                      # the state goes to disk
    disk.fail = True
    out = call_in_thread(opt.step, 8, "step() hangs after a failed state write")
    assert isinstance(out, SwapError) and out.errno == errno.ENOSPC, out
    assert "No space left" in str(out)
    disk.fail = False               # the disk has room again: the next step goes through
    opt.step()
    assert all(len(opt.state[p]) > 0 for p in model.parameters())
    opt.close()


def test_factored_state_of_a_column_weight_fits_the_buffers(tmp_path):
    """Adafactor keeps n + 1 elements of state for an (n, 1) weight; a 1-D probe predicts n."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1000, bias=False)
    ref = torch.nn.Linear(1, 1000, bias=False)
    ref.load_state_dict(model.state_dict())
    opt = NVMeOptimizer(model.parameters(), torch.optim.Adafactor, swap_dir=tmp_path)
    ref_opt = torch.optim.Adafactor(ref.parameters())
    for step in range(2):
        x = torch.randn(2, 1, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
    assert torch.equal(model.weight, ref.weight)
    opt.close()


def test_failed_add_param_group_changes_nothing(tmp_path):
    small = torch.nn.Parameter(torch.zeros(10))
    big = torch.nn.Parameter(torch.zeros(10000))
    opt = NVMeOptimizer([small], torch.optim.Adam, swap_dir=tmp_path)
    with pytest.raises(ValueError, match="swap buffers hold"):
        opt.add_param_group({"params": [big]})
    assert len(opt.param_groups) == 1 and opt.num_sub_groups == 1
    small.grad = torch.ones(10)
    opt.step()
    ref = torch.nn.Parameter(torch.zeros(10))
    ref.grad = torch.ones(10)
    torch.optim.Adam([ref]).step()
    assert torch.equal(small, ref)
    # a group that fits is still accepted afterwards
    other = torch.nn.Parameter(torch.zeros(10))
    opt.add_param_group({"params": [other]})
    assert len(opt.param_groups) == 2 and opt.num_sub_groups == 2
    opt.close()
