"""Shuffled token samples far apart take the reader's planned path (rows planned together,
handed to the handle without a second range check): the tokens are exact on both small-read
paths, with DataLoader workers too, and a short, failing or cut-off read still fails or is
resubmitted as on any batch."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from deepnvme.config import IOConfig
from deepnvme.data import TokenDataset, write_token_dataset
from deepnvme.errors import DeepNVMeIOError
from deepnvme.handles.aio import AioHandle
from deepnvme.memory.pinned import is_pinned

from ...fake_queues import install_faulty_queue
from ..io._kernel_handles import KERNEL_ENGINES

SEQ = 2048  # a uint16 sample spans two or three pages: samples a few apart need reads of their own


@pytest.fixture
def corpus(tmp_path):
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 65535, (int(n),), generator=g) for n in torch.randint(1, 30000, (30,), generator=g)]
    prefix = str(tmp_path / "c")
    write_token_dataset(prefix, docs, dtype=torch.uint16)
    return prefix, torch.cat(docs).to(torch.int64)


def _rows(tokens, order):
    return torch.stack([tokens[i * SEQ:i * SEQ + SEQ + 1] for i in order])


def _apart(count, n, seed=0):
    """``n`` samples in a shuffled order, every two at least five samples apart (plan_apart's margin)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(count // 5, generator=g)[:n] * 5).tolist()


def _spy(monkeypatch):
    calls = []
    real = AioHandle._read_planned
    monkeypatch.setattr(AioHandle, "_read_planned", lambda self, *a, **k: calls.append(a[0]) or real(self, *a, **k))
    return calls


def test_apart_samples_take_the_planned_path(corpus, monkeypatch, small_reads):
    prefix, tokens = corpus
    calls = _spy(monkeypatch)
    with TokenDataset(prefix, seq_len=SEQ) as ds:
        order = _apart(len(ds), 40)
        for batch_size, prefetch in ((3, 4), (8, 1), (5, 16)):
            calls.clear()
            got = list(ds.batches(order, batch_size, prefetch=prefetch))
            assert torch.equal(torch.cat(got), _rows(tokens, order)) and calls and set(calls) == {ds.bin_path}
            assert [len(b) for b in got[:-1]] == [batch_size] * (len(got) - 1)
        mixed = order[:10] + [order[0] + 1, order[0]] + order[10:20] + [-1]  # near, repeated, negative
        assert torch.equal(torch.cat(list(ds.batches(mixed, 4, prefetch=8))),
                           _rows(tokens, [i % len(ds) for i in mixed]))
        calls.clear()
        assert torch.equal(torch.stack(ds.__getitems__(order[:7])), _rows(tokens, order[:7])) and len(calls) == 1
    with TokenDataset(prefix, seq_len=SEQ, keep_dtype=True) as ds:
        got = list(ds.batches(order, 6, pin_memory=True, drop_last=True))
        assert got[0].dtype == torch.uint16 and all(is_pinned(b) for b in got) and len(got) == len(order) // 6
        assert torch.equal(torch.cat(got).to(torch.int64), _rows(tokens, order[:len(got) * 6]))
        one = ds.__getitems__(order[:5])
        assert one[0].dtype == torch.uint16 and torch.equal(torch.stack(one).to(torch.int64), _rows(tokens, order[:5]))


def test_consecutive_samples_are_one_planned_read_per_group(corpus, monkeypatch):
    """A sequential order is read one span per group (a read of the group's samples, through the
    planned path), the tokens exact; the run that meets the end of the file is planned apart."""
    prefix, tokens = corpus
    calls = _spy(monkeypatch)
    sizes = []
    real = AioHandle._read_planned
    monkeypatch.setattr(AioHandle, "_read_planned",
                        lambda self, path, buf, ranges, *a, **k: sizes.append(ranges[2].tolist())
                        or real(self, path, buf, ranges, *a, **k))
    with TokenDataset(prefix, seq_len=SEQ) as ds:
        order = list(range(7, 7 + 48))
        got = list(ds.batches(order, 4, prefetch=4))  # groups of 2 batches: 8 samples, one read each
        assert torch.equal(torch.cat(got), _rows(tokens, order))
        assert len(sizes) == 6 and all(len(s) == 1 and s[0] == 8 * SEQ * 2 + 4096 for s in sizes)
        tail = list(range(len(ds) - 10, len(ds)))
        calls.clear()
        assert torch.equal(torch.cat(list(ds.batches(tail, 5, prefetch=4))), _rows(tokens, tail))


@pytest.mark.skipif(not KERNEL_ENGINES, reason="no kernel engine on this system")
@pytest.mark.parametrize("engine", KERNEL_ENGINES)
def test_consecutive_samples_are_checked_like_any_batch(corpus, monkeypatch, engine):
    """A group's one read of consecutive samples still has every completion checked: short and
    interrupted ones resubmitted, a failure naming the file."""
    prefix, tokens = corpus
    config = IOConfig(engine=engine, queue_depth=8)
    calls = _spy(monkeypatch)
    order = list(range(100, 164))
    with pytest.MonkeyPatch.context() as mp:
        queues = install_faulty_queue(mp, engine, max_len=8192, eintr_every=3)
        with TokenDataset(prefix, seq_len=SEQ, config=config) as ds:
            assert torch.equal(torch.cat(list(ds.batches(order, 8, prefetch=8))), _rows(tokens, order))
        assert calls and sum(q.calls["short"] for q in queues) and sum(q.calls["eintr"] for q in queues)
    with pytest.MonkeyPatch.context() as mp:
        install_faulty_queue(mp, engine, fail_read_at=0, errno_=errno.EIO)
        with TokenDataset(prefix, seq_len=SEQ, config=config) as ds:
            with pytest.raises(DeepNVMeIOError, match=r"c\.bin") as info:
                list(ds.batches(order, 8, prefetch=8))
            assert info.value.errno == errno.EIO


@pytest.mark.parametrize("prefetch, calls", [(1, 10), (2, 10), (3, 10), (8, 3), (16, 2)])
def test_batches_are_read_in_groups_of_half_the_prefetch(corpus, monkeypatch, prefetch, calls):
    """One read call per group of ``prefetch // 2`` batches (at least one): two calls in flight,
    each call's cost shared by as many batches as that allows."""
    prefix, tokens = corpus
    made = _spy(monkeypatch)
    with TokenDataset(prefix, seq_len=SEQ) as ds:
        order = _apart(len(ds), 40, seed=6)
        assert torch.equal(torch.cat(list(ds.batches(order, 4, prefetch=prefetch))), _rows(tokens, order))
        assert len(made) == calls


def test_batches_are_fresh_tensors(corpus):
    """Batches picked through one reused scratch are not views of it: a later batch never
    changes an earlier one."""
    prefix, tokens = corpus
    for keep in (False, True):
        with TokenDataset(prefix, seq_len=SEQ, keep_dtype=keep) as ds:
            order = _apart(len(ds), 48, seed=1)
            got = list(ds.batches(order, 4, prefetch=4))
            assert len({b.untyped_storage().data_ptr() for b in got}) == len(got)
            assert torch.equal(torch.cat(got).to(torch.int64), _rows(tokens, order))


def test_dataloader_workers_read_apart_samples(corpus, monkeypatch):
    prefix, tokens = corpus
    ds = TokenDataset(prefix, seq_len=SEQ)
    order = _apart(len(ds), 36, seed=2)
    ds[0]  # the parent's handle is up before the workers fork
    loader = torch.utils.data.DataLoader(ds, batch_size=6, sampler=order, num_workers=2,
                                         multiprocessing_context="fork")
    assert torch.equal(torch.cat(list(loader)), _rows(tokens, order))
    calls = _spy(monkeypatch)
    inline = torch.utils.data.DataLoader(ds, batch_size=6, sampler=order)
    assert torch.equal(torch.cat(list(inline)), _rows(tokens, order)) and len(calls) == len(order) // 6


@pytest.mark.skipif(not KERNEL_ENGINES, reason="no kernel engine on this system")
@pytest.mark.parametrize("engine", KERNEL_ENGINES)
def test_planned_reads_are_checked_like_any_batch(corpus, monkeypatch, engine, small_reads):
    prefix, tokens = corpus
    config = IOConfig(engine=engine, queue_depth=8)
    calls = _spy(monkeypatch)
    with pytest.MonkeyPatch.context() as mp:  # short completions: resubmitted for the remainder
        queues = install_faulty_queue(mp, engine, max_len=4096, eintr_every=5)
        with TokenDataset(prefix, seq_len=SEQ, config=config) as ds:
            order = _apart(len(ds), 24, seed=3)
            assert torch.equal(torch.cat(list(ds.batches(order, 4, prefetch=4))), _rows(tokens, order))
        assert calls and sum(q.calls["eintr"] for q in queues)
    with pytest.MonkeyPatch.context() as mp:  # a failed read fails the batch naming the file
        install_faulty_queue(mp, engine, fail_read_at=0, errno_=errno.EIO)
        with TokenDataset(prefix, seq_len=SEQ, config=config) as ds:
            with pytest.raises(DeepNVMeIOError, match=r"c\.bin") as info:
                list(ds.batches(order, 4))
            assert info.value.errno == errno.EIO
    with TokenDataset(prefix, seq_len=SEQ, config=config) as ds:  # the file cut after opening
        ds[0]
        os.truncate(ds.bin_path, os.path.getsize(ds.bin_path) // 2)
        far = [i for i in order if i > len(ds) // 2][:4]
        with pytest.raises(DeepNVMeIOError, match=r"c\.bin"):
            list(ds.batches(far, 4))


def test_samples_at_uneven_offsets_are_picked_by_index(corpus, monkeypatch):
    """seq_len 2047: samples start at different bytes of their slots (no strided view): the
    rows are picked by index, through the same planned reads."""
    prefix, tokens = corpus
    calls = _spy(monkeypatch)
    with TokenDataset(prefix, seq_len=2047) as ds:
        order = _apart(len(ds), 30, seed=4)
        plan = ds._reader.plan_rows(torch.tensor([order[:6]]))[0]
        assert plan is not None and plan.step is None
        expected = torch.stack([tokens[i * 2047:i * 2047 + 2048] for i in order])
        assert torch.equal(torch.cat(list(ds.batches(order, 4, prefetch=8))), expected)
        assert torch.equal(torch.stack(ds.__getitems__(order[:9])), expected[:9]) and calls


def test_read_buffers_are_kept_for_the_next_iterator_until_close(corpus):
    """The page-locked read-ahead pool outlives an iterator (one per dataset, same sizes reused,
    other sizes replace it) and close() frees it."""
    from deepnvme.memory.pinned import locked_bytes

    prefix, tokens = corpus
    before = locked_bytes()
    ds = TokenDataset(prefix, seq_len=SEQ)
    order = _apart(len(ds), 20, seed=5)
    assert torch.equal(torch.cat(list(ds.batches(order, 4, prefetch=4))), _rows(tokens, order))
    (first,) = ds._reader._pools
    held = locked_bytes()
    assert held > before
    it = ds.batches(order, 4, prefetch=4)
    next(it)
    assert ds._reader._pools == []  # taken by the running iterator
    assert torch.equal(torch.cat(list(ds.batches(order, 4, prefetch=4))), _rows(tokens, order))  # a second pool
    it.close()
    assert len(ds._reader._pools) == 1 and locked_bytes() == held  # one kept, the other freed
    list(ds.batches(order, 8, prefetch=4))  # other sizes: the kept pool is replaced
    assert ds._reader._pools[0][1] is not first[1] and ds._reader._pools[0][1].buffer_bytes != first[1].buffer_bytes
    assert pickle_free(ds)
    ds.close()
    assert ds._reader._pools == [] and locked_bytes() == before


def pickle_free(ds):
    """A pickled dataset carries no pool."""
    import pickle

    return pickle.loads(pickle.dumps(ds))._reader._pools == []
