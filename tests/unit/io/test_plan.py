"""The planner is pure: exact coverage, alignment of direct chunks, edges buffered."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepnvme.io.plan import PAGE_SIZE, Alignment, Kind, align_down, align_up, plan_transfer

ALIGNS = st.sampled_from([Alignment(512, 512), Alignment(4, 512), Alignment(4096, 4096),
                          Alignment(512, 4096)])


@settings(max_examples=400, deadline=None)
@given(size=st.integers(0, 5 << 20), offset=st.integers(0, 1 << 22), address=st.integers(0, 1 << 20),
       block=st.sampled_from([1, 100, 4096, 65536, 1 << 20, 3 * 4096 + 7]), alignment=ALIGNS)
def test_chunks_cover_request_exactly(size, offset, address, block, alignment):
    chunks = plan_transfer(size=size, file_offset=offset, address=address, block_size=block,
                           alignment=alignment)
    pos = offset
    for c in chunks:
        assert c.file_offset == pos and c.length > 0
        assert c.buf_offset == c.file_offset - offset
        pos += c.length
        if c.kind is Kind.BUFFERED:
            continue
        edge = max(alignment.offset, PAGE_SIZE)
        assert c.file_offset % edge == 0 and c.length % edge == 0
        assert c.length <= max(align_down(block, edge), edge)
        mem_aligned = (address + c.buf_offset) % alignment.memory == 0
        assert (c.kind is Kind.DIRECT) == mem_aligned
    assert pos == offset + size


@given(size=st.integers(0, 1 << 20), offset=st.integers(0, 1 << 20), block=st.integers(64, 1 << 18))
def test_without_direct_everything_is_buffered(size, offset, block):
    chunks = plan_transfer(size=size, file_offset=offset, address=7, block_size=block, alignment=None)
    assert all(c.kind is Kind.BUFFERED and c.length <= block for c in chunks)
    assert sum(c.length for c in chunks) == size


def test_edges_and_middle():
    # 12388 bytes at 4000: a 96-byte head, three aligned pages, a 4-byte tail
    chunks = plan_transfer(size=3 * 4096 + 100, file_offset=4000, address=40960 - 96,
                           block_size=4096, alignment=Alignment(512, 512))
    assert [(c.kind, c.file_offset, c.length) for c in chunks] == [
        (Kind.BUFFERED, 4000, 96), (Kind.DIRECT, 4096, 4096), (Kind.DIRECT, 8192, 4096),
        (Kind.DIRECT, 12288, 4096), (Kind.BUFFERED, 16384, 4)]


def test_misaligned_memory_uses_bounce():
    chunks = plan_transfer(size=8192, file_offset=0, address=1, block_size=4096,
                           alignment=Alignment(512, 512))
    assert [c.kind for c in chunks] == [Kind.BOUNCE, Kind.BOUNCE]


def test_small_request_inside_one_page_is_one_buffered_chunk():
    chunks = plan_transfer(size=10, file_offset=5, address=0, block_size=1 << 20,
                           alignment=Alignment(512, 512))
    assert [(c.kind, c.length) for c in chunks] == [(Kind.BUFFERED, 10)]


def test_bad_inputs():
    with pytest.raises(ValueError):
        plan_transfer(size=-1, file_offset=0, address=0, block_size=1, alignment=None)
    with pytest.raises(ValueError):
        plan_transfer(size=1, file_offset=0, address=0, block_size=0, alignment=None)
    with pytest.raises(ValueError):
        Alignment(memory=3, offset=512)


def test_align_helpers():
    assert align_up(0, 512) == 0 and align_up(1, 512) == 512 and align_up(512, 512) == 512
    assert align_down(511, 512) == 0 and align_down(1025, 512) == 1024
