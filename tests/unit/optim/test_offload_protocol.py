"""The seam between optim and offload: a protocol defined in optim, which never imports offload."""

import subprocess
import sys

import pytest
import torch

from deepnvme.optim._protocol import OffloadedParameters, find_offload, mark_offloaded, offload_of


class Fake:
    """Everything the optimizer calls, doing nothing."""

    def update_bytes(self):
        return 1

    def check_updatable(self, params):
        pass

    def zero_grad(self):
        pass

    def prefetch_update(self, params):
        pass

    def begin_update(self, params):
        pass

    def end_update(self, params):
        pass

    def abort_update(self, params):
        pass

    def finish_updates(self):
        pass

    def set_gradient_consumer(self, consumer):
        pass

    def set_update_notice(self, notice):
        pass

    def prefetch_slice(self, param, start, stop):
        pass

    def begin_slice(self, param, start, stop):
        return param, None

    def end_slice(self, param, start, stop):
        pass

    def abort_slice(self, param, start, stop):
        pass


def test_the_mark_finds_the_one_offload_and_refuses_two():
    a, b, free = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    one, two = Fake(), Fake()
    assert isinstance(one, OffloadedParameters)
    mark_offloaded(a, one)
    assert offload_of(a) is one and offload_of(free) is None
    assert find_offload([free, a, a]) is one and find_offload([free]) is None
    mark_offloaded(b, two)
    with pytest.raises(ValueError, match="several offload_parameters calls"):
        find_offload([a, b])


def test_a_mark_that_is_not_an_offload_is_an_error():
    p = torch.nn.Parameter(torch.ones(2))
    mark_offloaded(p, object())
    with pytest.raises(TypeError, match="holds a object, not an offload"):
        offload_of(p)


def test_optim_does_not_load_offload():
    code = ("import sys; from deepnvme.optim import NVMeOptimizer; "
            "print('deepnvme.offload' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
