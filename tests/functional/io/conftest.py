"""The ``kernel`` fixture: each kernel engine available here (io_uring, Linux AIO) in turn."""

import pytest

from ._kernel_handles import KERNEL_ENGINES


@pytest.fixture(params=KERNEL_ENGINES)
def kernel(request):
    return request.param
