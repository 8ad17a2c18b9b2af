"""mapped_at: buffers whose address matches a file offset modulo the alignment (O_DIRECT reads
land without bounce buffers). That the large ones leave the heap is measured, as peak RSS, by
tests/functional/offload/test_memory_bound.py."""

import mmap

import pytest
import torch

from deepnvme.memory.heap import MAPPED_MIN, mapped_at


@pytest.mark.parametrize("nbytes", [100, 4096, MAPPED_MIN - 1, MAPPED_MIN, 3 * MAPPED_MIN + 5])
@pytest.mark.parametrize("offset", [0, 1, 123, 4095, 4096 + 77, 10**9 + 3])
def test_the_address_is_congruent_to_the_file_offset(nbytes, offset):
    t = mapped_at(nbytes, offset)
    assert t.dtype == torch.uint8 and t.numel() == nbytes
    assert t.data_ptr() % mmap.PAGESIZE == offset % mmap.PAGESIZE
    t.fill_(7)                                  # the whole view is writable memory
    assert int(t[-1]) == 7 and int(t[0]) == 7

