"""TokenDataset and write_token_dataset on real files, checked against megatron-core's own reader
and writer (``IndexedDataset``, ``IndexedDatasetBuilder``) where megatron-core is installed."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from deepnvme.data import DatasetFormatError, TokenDataset, write_token_dataset
from deepnvme.errors import DeepNVMeIOError
from deepnvme.memory.pinned import is_pinned

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "src")

with warnings.catch_warnings():  # megatron-core warns at import that Apex/TE are missing
    warnings.simplefilter("ignore")
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    except ImportError:
        IndexedDataset = IndexedDatasetBuilder = None

needs_megatron = pytest.mark.skipif(IndexedDataset is None,
                                    reason="megatron-core is not installed (pip install megatron-core)")


def _documents(seed=0, n=60, hi=60000):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 700, (n,), generator=g).tolist()
    lengths[3] = 0  # an empty document
    return [torch.randint(0, hi, (k,), generator=g) for k in lengths]


def _concat(docs):
    return torch.cat([d.to(torch.int64) for d in docs])


def _check_samples(ds, tokens, order=None):
    n = ds.seq_len
    assert len(ds) == (len(tokens) - 1) // n
    for i in (range(len(ds)) if order is None else order):
        assert torch.equal(ds[i], tokens[i * n:i * n + n + 1]), i


@needs_megatron
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_written_files_read_by_megatron_and_by_deepnvme(tmp_path, dtype):
    docs = _documents()
    mixed = [d.numpy().astype(dtype) if j % 3 == 0 else d.tolist() if j % 3 == 1 else d
             for j, d in enumerate(docs)]
    prefix = str(tmp_path / "corpus")
    write_token_dataset(prefix, mixed, dtype=dtype)
    m = IndexedDataset(prefix)
    assert len(m) == len(docs) and m.document_indices.tolist() == list(range(len(docs) + 1))
    ds = TokenDataset(prefix, seq_len=37)
    assert ds.num_documents == len(docs) and ds.dtype == torch.from_numpy(np.zeros(1, dtype)).dtype
    for j in range(len(docs)):
        assert torch.equal(ds.document(j), torch.from_numpy(m[j].astype(np.int64)))
        assert torch.equal(torch.from_numpy(m[j].astype(np.int64)), docs[j])
    # every sample equals the slice of the concatenation read through megatron-core
    tokens = torch.from_numpy(np.concatenate([m[j] for j in range(len(m))]).astype(np.int64))
    _check_samples(ds, tokens)


@needs_megatron
def test_files_from_megatrons_builder(tmp_path):
    prefix = str(tmp_path / "built")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    docs = _documents(seed=1, n=20)
    for d in docs[:10]:
        b.add_item(d)
        b.end_document()
    # one document made of three sequences
    b.add_document(torch.cat(docs[10:13]), [len(d) for d in docs[10:13]])
    for d in docs[13:]:
        b.add_item(d)
        b.end_document()
    b.finalize(prefix + ".idx")
    m = IndexedDataset(prefix)
    ds = TokenDataset(prefix, seq_len=64)
    assert ds.num_sequences == len(m) == 20 and ds.num_documents == 18
    assert torch.equal(ds.document(10), _concat(docs[10:13]))
    for j in range(10):
        assert torch.equal(ds.document(j), torch.from_numpy(m[j].astype(np.int64)))
    tokens = torch.from_numpy(np.concatenate([m[j] for j in range(len(m))]).astype(np.int64))
    _check_samples(ds, tokens)


@pytest.fixture
def corpus(tmp_path):
    docs = _documents(seed=2, n=80)
    prefix = str(tmp_path / "c")
    write_token_dataset(prefix, docs)
    return prefix, _concat(docs)


def _rows(tokens, order, n):
    return torch.stack([tokens[i * n:i * n + n + 1] for i in order])


@pytest.mark.parametrize("batch_size, prefetch", [(1, 1), (7, 2), (32, 8), (5, 16)])
def test_batches_in_any_order(corpus, batch_size, prefetch):
    prefix, tokens = corpus
    with TokenDataset(prefix, seq_len=50) as ds:
        g = torch.Generator().manual_seed(batch_size)
        for order in (torch.randperm(len(ds), generator=g), list(range(len(ds))),
                      list(range(len(ds) - 1, -1, -1)), [5, 5, 0, -1, 3] * 9):
            got = list(ds.batches(order, batch_size, prefetch=prefetch))
            order = [int(i) for i in order]
            assert [len(b) for b in got[:-1]] == [batch_size] * (len(got) - 1)
            assert torch.equal(torch.cat(got), _rows(tokens, [i % len(ds) for i in order], 50))
            assert got[0].dtype == torch.int64 and got[0].shape[1] == 51


def test_batches_options(corpus):
    prefix, tokens = corpus
    ds = TokenDataset(prefix, seq_len=50, keep_dtype=True)
    order = list(range(len(ds)))
    got = list(ds.batches(order, 10, drop_last=True, pin_memory=True))
    assert len(got) == len(ds) // 10 and all(len(b) == 10 for b in got)
    assert got[0].dtype == torch.uint16 and all(is_pinned(b) for b in got)
    assert torch.equal(torch.cat(got).to(torch.int64), _rows(tokens, order[:len(got) * 10], 50))
    assert ds[0].dtype == torch.uint16
    assert list(ds.batches([], 4)) == []


def test_batches_to_a_device_go_through_one_staging_batch(corpus, monkeypatch):
    prefix, tokens = corpus
    ds = TokenDataset(prefix, seq_len=50)
    order = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    assert torch.equal(torch.cat(list(ds.batches(order, 4, device="cpu"))), _rows(tokens, order, 50))
    staged = []
    real_to = torch.Tensor.to

    def record(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device):  # moves to the device (not dtype conversions)
            staged.append((self.data_ptr(), is_pinned(self), self.clone()))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", record)
    got = list(ds.batches(order, 4, device="meta"))  # the staging path, with no GPU needed
    monkeypatch.undo()
    assert [b.device.type for b in got] == ["meta"] * 3 and [b.shape[0] for b in got] == [4, 4, 3]
    assert len({ptr for ptr, _, _ in staged}) == 1 and all(pinned for _, pinned, _ in staged)
    assert torch.equal(torch.cat([copy for _, _, copy in staged]), _rows(tokens, order, 50))
    for bad in ("nonsense", "cuda:0" if not torch.cuda.is_available() else "nonsense:1"):
        with pytest.raises(ValueError, match="batches\\(device="):
            ds.batches(order, 4, device=bad)


def test_batches_errors_and_early_exit(corpus):
    prefix, _tokens = corpus
    ds = TokenDataset(prefix, seq_len=50)
    it = ds.batches(list(range(len(ds))), 3, prefetch=4)
    next(it)
    it.close()  # waits for the reads in flight, frees the buffers
    with pytest.raises(IndexError, match=f"sample {len(ds)} out of range"):
        list(ds.batches([0, 1, len(ds)], 2))
    for bad in ({"batch_size": 0}, {"batch_size": 2, "prefetch": 0}):
        with pytest.raises(ValueError):
            ds.batches([0], **bad)
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert torch.equal(ds[-1], ds[len(ds) - 1])
    with pytest.raises(ValueError, match="seq_len"):
        TokenDataset(prefix, seq_len=0)


def test_tiny_corpus_has_no_samples(tmp_path):
    write_token_dataset(tmp_path / "t", [[1, 2, 3]])
    ds = TokenDataset(tmp_path / "t", seq_len=3)
    assert len(ds) == 0 and ds.total_tokens == 3 and torch.equal(ds.document(0), torch.tensor([1, 2, 3]))
    assert len(TokenDataset(tmp_path / "t", seq_len=2)) == 1


def test_dataloader_workers_open_their_own_handle(corpus):
    prefix, tokens = corpus
    ds = TokenDataset(prefix, seq_len=50)
    ds[0]  # the parent has a handle with live threads before the workers fork
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, shuffle=False)
    got = torch.cat(list(loader))
    assert torch.equal(got, _rows(tokens, range(len(ds)), 50))
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._reader._handle is None and torch.equal(clone[3], ds[3])


def test_dataloader_batches_read_with_one_call_per_batch(corpus, monkeypatch):
    prefix, tokens = corpus
    ds = TokenDataset(prefix, seq_len=50)
    calls = []
    real = ds._reader.samples
    monkeypatch.setattr(ds._reader, "samples", lambda idx: calls.append(list(idx)) or real(idx))
    order = [9, 2, 2, 0, len(ds) - 1, 5, 7]
    loader = torch.utils.data.DataLoader(ds, batch_size=3, sampler=order)
    assert torch.equal(torch.cat(list(loader)), _rows(tokens, order, 50))
    assert calls == [order[0:3], order[3:6], order[6:]]  # one plan and one read call per batch
    with pytest.raises(IndexError, match="out of range"):
        ds.__getitems__([0, len(ds)])
    monkeypatch.undo()
    workers = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, shuffle=False,
                                          multiprocessing_context="fork")
    assert torch.equal(torch.cat(list(workers)), _rows(tokens, range(len(ds)), 50))


def test_a_bin_cut_short_after_opening_fails_naming_it(corpus, tmp_path):
    prefix, _tokens = corpus
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as src, open(tmp_path / f"cut{ext}", "wb") as dst:
            dst.write(src.read())
    ds = TokenDataset(tmp_path / "cut", seq_len=50)
    os.truncate(tmp_path / "cut.bin", ds.geometry.base + 100)
    with pytest.raises(DeepNVMeIOError, match=r"cut\.bin") as info:
        list(ds.batches([len(ds) - 1, 0], 2))
    assert "offset" in str(info.value)
    with pytest.raises(DeepNVMeIOError, match=r"cut\.bin"):
        ds.__getitems__([len(ds) - 1])


def test_truncated_bin_and_bad_index_files(corpus, tmp_path):
    prefix, _tokens = corpus
    size = os.path.getsize(prefix + ".bin")
    os.truncate(prefix + ".bin", size - 1)
    past = r"c\.idx: sequence pointers: sequence 79 ends at byte \d+ but \S+c\.bin holds"
    with pytest.raises(DatasetFormatError, match=past):
        TokenDataset(prefix, seq_len=8)
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"NOTANIDX!")
    with pytest.raises(DatasetFormatError, match=r"c\.idx: magic"):
        TokenDataset(prefix, seq_len=8)
    with pytest.raises(FileNotFoundError, match="missing"):
        TokenDataset(tmp_path / "missing", seq_len=8)


def test_writer_creates_missing_folders(tmp_path):
    prefix = tmp_path / "new" / "deeper" / "c"
    write_token_dataset(prefix, [[1, 2, 3], [4, 5]])
    assert sorted(os.listdir(tmp_path / "new" / "deeper")) == ["c.bin", "c.idx"]
    with TokenDataset(prefix, seq_len=2) as ds:
        assert ds.document(1).tolist() == [4, 5] and ds[1].tolist() == [3, 4, 5]


def test_writer_checks_tokens_and_leaves_nothing_on_failure(tmp_path):
    with pytest.raises(ValueError, match="document 1: token 70000 does not fit uint16"):
        write_token_dataset(tmp_path / "a", [[1], [70000]])
    with pytest.raises(ValueError, match="document 0: tokens of dtype torch.float32"):
        write_token_dataset(tmp_path / "a", [torch.ones(3)])
    with pytest.raises(ValueError, match="cannot be stored"):
        write_token_dataset(tmp_path / "a", [[1]], dtype=torch.bfloat16)

    def failing():
        yield [1, 2]
        raise RuntimeError("tokenizer failed")
    with pytest.raises(RuntimeError):
        write_token_dataset(tmp_path / "a", failing())
    assert os.listdir(tmp_path) == []
    for dtype in ("int32", np.dtype("int32"), np.int32, torch.int32):
        write_token_dataset(tmp_path / "b", [[-5, 7], [2**31 - 1]], dtype=dtype)
        ds = TokenDataset(tmp_path / "b", seq_len=1)
        assert ds.dtype == torch.int32 and ds.document(1).tolist() == [2**31 - 1]


def test_without_numpy(tmp_path):
    script = textwrap.dedent("""
        import sys
        sys.modules["numpy"] = None  # as if NumPy were not installed
        import torch
        from deepnvme.data import TokenDataset, write_token_dataset
        docs = [list(range(i, i + 50)) for i in range(20)] + [torch.arange(30)]
        write_token_dataset(sys.argv[1], docs)
        ds = TokenDataset(sys.argv[1], seq_len=16)
        flat = torch.tensor([t for d in docs for t in (d if isinstance(d, list) else d.tolist())])
        got = torch.cat(list(ds.batches(range(len(ds)), 5)))
        assert torch.equal(got, torch.stack([flat[i * 16:i * 16 + 17] for i in range(len(ds))]))
        assert torch.equal(ds.document(20), torch.arange(30))
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "n")],
                          env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr
