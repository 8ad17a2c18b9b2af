"""cast_to_byte_tensor and the compat builders."""

import pytest
import torch

import deepnvme
from deepnvme.compat import AsyncIOBuilder, GDSBuilder, UtilsBuilder
from deepnvme.errors import UnsupportedBufferError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64,
                                   torch.complex64, torch.uint8])
def test_cast_to_byte_tensor_is_a_zero_copy_alias(dtype):
    t = torch.zeros(3, 5, dtype=dtype)
    b = deepnvme.cast_to_byte_tensor(t)
    assert b.dtype == torch.uint8 and b.dim() == 1 and b.numel() == t.numel() * t.element_size()
    assert b.data_ptr() == t.data_ptr()
    b.fill_(1)
    assert deepnvme.cast_to_byte_tensor(t).sum() == b.numel()


def test_cast_keeps_source_alive_and_handles_lists():
    b = deepnvme.cast_to_byte_tensor(torch.full((4,), 1.0))
    import gc
    gc.collect()
    assert b.view(torch.float32).tolist() == [1.0] * 4
    out = deepnvme.cast_to_byte_tensor([torch.zeros(2), torch.zeros(3, dtype=torch.float16)])
    assert [x.numel() for x in out] == [8, 6]
    assert deepnvme.cast_to_byte_tensor(torch.tensor(2.0)).numel() == 4  # 0-dim


def test_cast_errors():
    with pytest.raises(UnsupportedBufferError, match="non-contiguous"):
        deepnvme.cast_to_byte_tensor(torch.zeros(4, 4).t())
    with pytest.raises(TypeError):
        deepnvme.cast_to_byte_tensor(3)


def test_builders(tmp_path):
    assert AsyncIOBuilder().is_compatible()
    ops = AsyncIOBuilder().load()
    h = ops.aio_handle(1 << 20, 32, False, False, 2)
    assert isinstance(h, deepnvme.AioHandle) and h.get_intra_op_parallelism() == 2
    t = torch.arange(100, dtype=torch.float32)
    assert h.sync_pwrite(t, str(tmp_path / "x")) == 1
    h.close()
    util = UtilsBuilder().load()
    assert util.cast_to_byte_tensor(t).numel() == 400


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_gds_builder_without_cuda_is_a_clear_error():
    assert GDSBuilder().is_compatible() is False
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        GDSBuilder().load()
