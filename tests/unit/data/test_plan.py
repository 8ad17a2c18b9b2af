"""Read planning for token samples (pure): every plan, executed against bytes in memory, yields
exactly each sample's bytes; reads are aligned, capped and coalesced; the memory bound holds.
Plans are int64 tensors (one element per read or sample)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepnvme.data._plan import SampleGeometry, batch_buffer_bytes, plan_apart, plan_batch, plan_runs


def _geometry(base=0, itemsize=2, seq_len=8, tokens_total=1000):
    count = max((tokens_total - 1) // seq_len, 0)
    return SampleGeometry(base=base, itemsize=itemsize, stride=seq_len, tokens=seq_len + 1, count=count,
                          file_size=base + tokens_total * itemsize)


def _execute(plan, file: bytes) -> bytearray:
    buf = bytearray(plan.buffer_bytes)
    for at, off, n in plan.reads:
        assert off + n <= len(file), "read past the end of the file"
        buf[at:at + n] = file[off:off + n]
    return buf


@given(st.data(), st.sampled_from([1, 2, 4, 8]), st.integers(1, 300), st.integers(2, 5000),
       st.sampled_from([512, 4096]), st.sampled_from([0, 4096]), st.sampled_from([4096, 16384, 1 << 20]))
def test_plan_reads_every_sample_exactly(data, itemsize, seq_len, tokens_total, alignment, gap, max_read):
    base = data.draw(st.integers(0, 3)) * itemsize * 5
    geo = _geometry(base, itemsize, seq_len, tokens_total)
    if geo.count == 0:
        return
    samples = data.draw(st.lists(st.integers(-geo.count, geo.count - 1), min_size=1, max_size=40))
    plan = plan_batch(samples, geo, alignment=alignment, max_read=max_read, gap=gap)
    file = bytes(i * 7 % 251 for i in range(geo.file_size))
    buf = _execute(plan, file)
    for k, i in enumerate(samples):
        start = base + (i % geo.count) * seq_len * itemsize
        assert buf[plan.sample_at[k]:plan.sample_at[k] + geo.sample_bytes] == file[start:start + geo.sample_bytes]
    for at, off, n in plan.reads:
        assert at % alignment == 0 and off % alignment == 0
        assert (off + n) % alignment == 0 or off + n == geo.file_size
        assert n <= max(max_read, geo.sample_bytes + 2 * alignment)
    assert plan.buffer_bytes <= batch_buffer_bytes(len(samples), geo, alignment=alignment, gap=gap)


@given(st.data(), st.sampled_from([1, 2, 4]), st.integers(1, 300), st.integers(2, 20000),
       st.sampled_from([512, 4096]), st.sampled_from([4096, 16384, 1 << 20]), st.sampled_from([0, 1]))
def test_runs_of_consecutive_samples_are_read_exactly(data, itemsize, seq_len, tokens_total, alignment, max_read,
                                                      step):
    """Consecutive samples (or one repeated), planned by the per-read path, meet the same contract."""
    geo = _geometry(data.draw(st.integers(0, 3)) * itemsize * 5, itemsize, seq_len, tokens_total)
    if geo.count < 2:
        return
    first = data.draw(st.integers(0, geo.count - 2))
    samples = [first + k * step for k in range(data.draw(st.integers(2, geo.count - first)) if step else 7)]
    plan = plan_batch(samples, geo, alignment=alignment, max_read=max_read, gap=0)
    file = bytes(i * 7 % 251 for i in range(geo.file_size))
    buf = _execute(plan, file)
    for k, i in enumerate(samples):
        start = geo.base + i * seq_len * itemsize
        assert buf[plan.sample_at[k]:plan.sample_at[k] + geo.sample_bytes] == file[start:start + geo.sample_bytes]
    for at, off, n in plan.reads:
        assert at % alignment == 0 and off % alignment == 0
        assert (off + n) % alignment == 0 or off + n == geo.file_size
        assert n <= max(max_read, geo.sample_bytes + 2 * alignment)
    assert plan.nbytes == sum(n for _, _, n in plan.reads)
    assert plan.buffer_bytes <= batch_buffer_bytes(len(samples), geo, alignment=alignment, gap=0)
    if plan.step is not None:
        assert plan.sample_at.tolist() == [plan.sample_at[0] + k * plan.step for k in range(len(samples))]


def test_sequential_samples_coalesce_into_one_read():
    geo = _geometry(seq_len=2048, itemsize=2, tokens_total=2048 * 100 + 1)
    plan = plan_batch(list(range(10, 42)), geo, alignment=4096, max_read=1 << 20, gap=0)
    assert len(plan.reads) == 1
    assert plan.reads[0][1] == 10 * 4096 and plan.reads[0][2] == 33 * 4096
    assert plan.sample_at.tolist() == [k * 4096 for k in range(32)]
    assert plan.nbytes == 33 * 4096 and plan.buffer_bytes == 33 * 4096
    same = plan_batch(torch.arange(10, 42, dtype=torch.int32), geo, alignment=4096, max_read=1 << 20, gap=0)
    assert same.reads == plan.reads and torch.equal(same.sample_at, plan.sample_at)


def test_cap_splits_long_runs_and_far_samples_stay_apart():
    geo = _geometry(seq_len=2048, itemsize=2, tokens_total=2048 * 100 + 1)
    plan = plan_batch(list(range(0, 32)), geo, alignment=4096, max_read=65536, gap=0)
    assert [(at, off, n) for at, off, n in plan.reads] == [(0, 0, 65536), (65536, 15 * 4096, 65536),
                                                           (131072, 30 * 4096, 12288)]
    assert plan.step is None and plan.sample_at.tolist()[14:17] == [14 * 4096, 65536, 65536 + 4096]
    backwards = plan_batch(list(range(31, -1, -1)), geo, alignment=4096, max_read=65536, gap=0)
    assert all(n <= 65536 for _, _, n in backwards.reads) and len(backwards.reads) == 3
    assert [off for _, off, _ in backwards.reads] == [0, 13 * 4096, 26 * 4096]
    alone = plan_batch(list(range(0, 8)), geo, alignment=4096, max_read=8192, gap=0)
    assert [n for _, _, n in alone.reads] == [8192] * 8  # a cap below one sample: a read each
    far = plan_batch([3, 50, 90], geo, alignment=4096, max_read=1 << 20, gap=0)
    assert [off for _, off, _ in far.reads] == [3 * 4096, 50 * 4096, 90 * 4096]
    near = plan_batch([3, 5], geo, alignment=4096, max_read=1 << 20, gap=4096)
    assert len(near.reads) == 1  # the one-page hole is read rather than a second request


def test_last_read_stops_at_the_end_of_the_file():
    geo = _geometry(seq_len=100, itemsize=2, tokens_total=1001)  # 2002 bytes, not page aligned
    plan = plan_batch([geo.count - 1], geo, alignment=4096, max_read=1 << 20, gap=0)
    assert plan.reads == ((0, 0, 2002),)


def test_order_is_kept_and_repeats_allowed():
    geo = _geometry(seq_len=2048, itemsize=2, tokens_total=2048 * 100 + 1)
    plan = plan_batch([7, 2, 7], geo, alignment=4096, max_read=1 << 20, gap=0)
    assert plan.sample_at[0] == plan.sample_at[2] != plan.sample_at[1]
    empty = plan_batch([], geo, alignment=4096, max_read=1 << 20, gap=0)
    assert empty.reads == () and empty.buffer_bytes == empty.nbytes == 0


def test_out_of_range_samples():
    geo = _geometry(tokens_total=1000)
    with pytest.raises(IndexError, match=f"sample {geo.count} out of range"):
        plan_batch([0, geo.count], geo, alignment=4096, max_read=1 << 20, gap=0)
    with pytest.raises(IndexError, match=f"sample {-geo.count - 1} out of range"):
        plan_batch(torch.tensor([-geo.count - 1, geo.count]), geo, alignment=4096, max_read=1 << 20, gap=0)
    with pytest.raises(IndexError, match="out of range"):
        geo.byte_range(-geo.count - 1)


@given(st.data(), st.sampled_from([1, 2, 4]), st.integers(1, 3000), st.integers(2, 200000),
       st.sampled_from([512, 4096]), st.sampled_from([0, 4096]), st.integers(1, 5), st.integers(1, 12))
def test_rows_planned_together_read_every_sample_exactly(data, itemsize, seq_len, tokens_total, alignment, gap,
                                                         rows, n):
    """plan_apart: each row's plan (or None) meets plan_batch's contract, its bounds are the exact
    bounds of its reads, and a row is None only when over an eighth of its samples are near
    another or a read meets the end of the file."""
    base = data.draw(st.integers(0, 3)) * itemsize * 5
    geo = _geometry(base, itemsize, seq_len, tokens_total)
    if geo.count == 0:
        return
    idx = torch.tensor(data.draw(st.lists(st.integers(0, geo.count - 1), min_size=rows * n, max_size=rows * n)),
                       dtype=torch.int64).view(rows, n)
    plans = plan_apart(idx, geo, alignment=alignment, gap=gap)
    file = bytes(i * 7 % 251 for i in range(geo.file_size))
    assert len(plans) == rows
    for r, plan in enumerate(plans):
        starts = sorted(base + i * seq_len * itemsize for i in idx[r].tolist())
        near = sum(b - a < geo.sample_bytes + gap + 2 * alignment for a, b in zip(starts, starts[1:]))
        end = max(-(-(s + geo.sample_bytes) // alignment) * alignment for s in starts)
        assert (plan is None) == (near * 8 > n or end > geo.file_size)
        if plan is None:
            continue
        buf = _execute(plan, file)
        for k, i in enumerate(idx[r].tolist()):
            start = base + i * seq_len * itemsize
            got = buf[plan.sample_at[k]:plan.sample_at[k] + geo.sample_bytes]
            assert got == file[start:start + geo.sample_bytes]
        reads = plan.reads
        assert len(reads) == n and plan.nbytes == sum(size for _, _, size in reads)
        assert plan.bounds == (min(o for _, o, _ in reads), max(o + size for _, o, size in reads),
                               min(size for _, _, size in reads), max(size for _, _, size in reads), alignment)
        assert all(a % alignment == 0 and o % alignment == 0 and size % alignment == 0 for a, o, size in reads)
        assert max(a + size for a, _, size in reads) <= plan.buffer_bytes
        assert plan.buffer_bytes <= batch_buffer_bytes(n, geo, alignment=alignment, gap=gap)
        assert plan.step == (None if seq_len * itemsize % alignment else plan.buffer_bytes // n)
        if plan.step is not None:
            assert plan.sample_at.tolist() == [plan.sample_at[0] + k * plan.step for k in range(n)]


def test_rows_planned_together_fall_back_where_samples_meet():
    geo = _geometry(seq_len=2048, itemsize=2, tokens_total=2048 * 100 + 1)
    idx = torch.tensor([[3, 50, 90], [7, 8, 60], [40, 9, 40], [0, 10, geo.count - 1]], dtype=torch.int64)
    far, near, repeat, last = plan_apart(idx, geo, alignment=4096, gap=4096)
    assert near is None and repeat is None
    assert far is not None and [off for _, off, _ in far.reads] == [3 * 4096, 50 * 4096, 90 * 4096]
    assert [at for at, _, _ in far.reads] == [0, 12288, 24576]  # the row's order, a slot each
    assert far.bounds == (3 * 4096, 90 * 4096 + 8192, 8192, 8192, 4096) and far.buffer_bytes == 3 * 12288
    assert last is None  # its last read would pass the end of the file (2 bytes past a page)
    few = torch.tensor([[5 * k for k in range(15)] + [20]], dtype=torch.int64)  # one repeat in 16
    (plan,) = plan_apart(few, geo, alignment=4096, gap=4096)
    assert plan is not None and len(plan.reads) == 16 and plan.reads[4][1:] == plan.reads[15][1:]
    odd = _geometry(seq_len=100, itemsize=2, tokens_total=1001)  # the last read stops at the file's end
    assert plan_apart(torch.tensor([[odd.count - 1]]), odd, alignment=4096, gap=0) == [None]


@given(st.data(), st.sampled_from([1, 2, 4]), st.integers(1, 3000), st.integers(2, 200000),
       st.sampled_from([512, 4096]), st.sampled_from([4096, 65536, 1 << 20, 5000]), st.integers(1, 5),
       st.integers(2, 40))
def test_runs_planned_together_read_every_sample_exactly(data, itemsize, seq_len, tokens_total, alignment, max_read,
                                                         rows, n):
    """plan_runs: a row of consecutive samples is its aligned span read back to back in reads of
    at most max_read bytes (None where the span passes the end of the file), its samples ``step``
    bytes apart in the buffer, its bounds exact; every other row is None."""
    geo = _geometry(data.draw(st.integers(0, 3)) * itemsize * 5, itemsize, seq_len, tokens_total)
    if geo.count < n:
        return
    firsts = data.draw(st.lists(st.integers(0, geo.count - n), min_size=rows, max_size=rows))
    broken = data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    table = []
    for first, brk in zip(firsts, broken):
        row = list(range(first, first + n))
        if brk:  # one sample moved out of the run (or repeated)
            k = data.draw(st.integers(1, n - 1))
            row[k] = data.draw(st.integers(0, geo.count - 1).filter(lambda i, want=row[k]: i != want))
        table.append(row)
    idx = torch.tensor(table, dtype=torch.int64)
    plans = plan_runs(idx, geo, alignment=alignment, max_read=max_read)
    file = bytes(i * 7 % 251 for i in range(geo.file_size))
    step, most = seq_len * itemsize, max_read - max_read % alignment
    assert len(plans) == rows
    for row, brk, plan in zip(table, broken, plans):
        start = geo.base + row[0] * step
        lo = start - start % alignment
        hi = -(-(start + (n - 1) * step + geo.sample_bytes) // alignment) * alignment
        whole = step <= geo.sample_bytes and not brk
        assert (plan is None) == (not whole or hi > geo.file_size)
        if plan is None:
            continue
        reads = plan.reads
        assert [(at, off) for at, off, _ in reads] == [(at, lo + at) for at in range(0, hi - lo, most)]
        assert all(size == most for _, _, size in reads[:-1]) and 0 < reads[-1][2] <= most
        assert plan.nbytes == plan.buffer_bytes == sum(size for _, _, size in reads) == hi - lo
        assert plan.bounds == (lo, hi, min(size for _, _, size in reads), max(size for _, _, size in reads),
                               alignment)
        assert plan.step == step and plan.buffer_bytes <= batch_buffer_bytes(n, geo, alignment=alignment, gap=0)
        buf = _execute(plan, file)
        for k, i in enumerate(row):
            at = int(plan.sample_at[k])
            assert at == int(plan.sample_at[0]) + k * step
            assert buf[at:at + geo.sample_bytes] == file[geo.base + i * step:geo.base + i * step + geo.sample_bytes]


def test_runs_are_planned_alone_where_they_cannot_be_one_span():
    geo = _geometry(seq_len=2048, itemsize=2, tokens_total=2048 * 100 + 1)
    runs = torch.tensor([[3, 4, 5], [7, 8, 60], [5, 5, 5], [geo.count - 3, geo.count - 2, geo.count - 1]])
    ok, apart, repeat, last = plan_runs(runs, geo, alignment=4096, max_read=1 << 20)
    assert ok is not None and ok.reads == ((0, 3 * 4096, 4 * 4096),) and ok.sample_at.tolist() == [0, 4096, 8192]
    assert apart is None and repeat is None
    assert last is None  # its read would pass the end of the file (2 bytes past a page)
    (cut,) = plan_runs(runs[:1], geo, alignment=4096, max_read=3 * 4096 + 100)  # over max_read: two reads
    assert cut is not None and cut.reads == ((0, 3 * 4096, 3 * 4096), (3 * 4096, 6 * 4096, 4096))
    assert plan_runs(runs[:1, :1], geo, alignment=4096, max_read=1 << 20) == [None]  # one sample: not a run
