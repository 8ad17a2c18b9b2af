"""Token datasets striped over a volume: written by write_token_dataset, read by TokenDataset
from every drive at once, equal to the same corpus in plain files."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import deepnvme
from deepnvme import Volume, VolumeLayoutError
from deepnvme.data import TokenDataset, write_token_dataset
from deepnvme.data import writer as writer_module


def _documents(n=120, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 60000, (int(k),), generator=g) for k in torch.randint(0, 900, (n,), generator=g)]


@pytest.fixture
def striped(tmp_path):
    docs = _documents()
    vol = Volume([tmp_path / "d0", tmp_path / "d1", tmp_path / "d2"], stripe="8K")
    write_token_dataset(vol / "corpus", docs)
    write_token_dataset(tmp_path / "plain" / "corpus", docs)
    return vol, tmp_path / "plain" / "corpus", torch.cat([d.to(torch.int64) for d in docs])


def test_samples_from_a_volume_equal_the_plain_files(striped):
    vol, plain, tokens = striped
    for drive in vol.paths:  # each drive holds a part of both files
        assert {"corpus.bin.part", "corpus.idx.part"} <= {n[:-1] for n in os.listdir(drive)}
    with TokenDataset(vol / "corpus", seq_len=64) as ds, TokenDataset(plain, seq_len=64) as ref:
        assert len(ds) == len(ref) == (len(tokens) - 1) // 64 and ds.bin_size == ref.bin_size
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
        want = torch.stack([tokens[i * 64:i * 64 + 65] for i in order])
        assert torch.equal(torch.stack(ds.__getitems__(order)), want)
        assert torch.equal(ds.document(7), ref.document(7)) and torch.equal(ds[len(ds) - 1], ref[len(ref) - 1])
        assert torch.equal(torch.cat(list(ds.batches(order, 16))), torch.stack(ds.__getitems__(order)))
        assert "corpus" in repr(ds) and "volume" in repr(ds)


def test_dataloader_workers_read_the_volume(striped):
    vol, _plain, tokens = striped
    ds = TokenDataset(vol / "corpus", seq_len=100)
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[5], ds[5])
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, shuffle=False,
                                         multiprocessing_context="fork")
    got = torch.cat(list(loader))
    assert torch.equal(got, torch.stack([tokens[i * 100:i * 100 + 101] for i in range(len(ds))]))


def test_read_many_into_a_volume_splits_ranges_over_drives(striped):
    vol, plain, _tokens = striped
    bin_size = os.path.getsize(f"{plain}.bin")
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 20000, (40,), generator=g)
    offsets = (torch.rand(40, generator=g) * (bin_size - sizes)).to(torch.int64)
    at = torch.cumsum(sizes, 0) - sizes
    buf = torch.zeros(int(sizes.sum()), dtype=torch.uint8)
    with deepnvme.AioHandle() as h:
        assert h.read_many_into(vol / "corpus.bin", buf, buffer_offsets=at, file_offsets=offsets,
                                sizes=sizes).result() == buf.numel()
    whole = torch.from_file(f"{plain}.bin", size=bin_size, dtype=torch.uint8)
    want = torch.cat([whole[o:o + n] for o, n in zip(offsets.tolist(), sizes.tolist())])
    assert torch.equal(buf, want)
    with deepnvme.AioHandle() as h, pytest.raises(Exception, match="corpus.bin"):
        h.read_many_into(vol / "corpus.bin", buf[:10], buffer_offsets=torch.tensor([0]),
                         file_offsets=torch.tensor([bin_size - 4]), sizes=torch.tensor([10])).result()


def test_a_volume_opened_with_a_drive_missing_is_refused(striped, tmp_path):
    vol, _plain, _tokens = striped
    with pytest.raises(VolumeLayoutError):
        TokenDataset(Volume(vol.paths[:2], stripe="8K") / "corpus", seq_len=64)
    with pytest.raises(VolumeLayoutError):
        TokenDataset(Volume(vol.paths, stripe="4K") / "corpus", seq_len=64)


def test_a_failed_write_leaves_the_previous_pair_and_no_temporary_files(striped, monkeypatch):
    vol, _plain, tokens = striped
    before = {d: sorted(os.listdir(d)) for d in vol.paths}

    def failing():
        yield [1, 2, 3]
        raise RuntimeError("tokenizer failed")
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        write_token_dataset(vol / "corpus", failing())
    monkeypatch.setattr(writer_module, "STRIPED_BLOCK", 4096)  # many blocks, then a bad token
    with pytest.raises(ValueError, match="does not fit uint16"):
        write_token_dataset(vol / "corpus", [list(range(5000)), [70000]])
    assert {d: sorted(os.listdir(d)) for d in vol.paths} == before
    with TokenDataset(vol / "corpus", seq_len=64) as ds:
        assert torch.equal(ds[3], tokens[3 * 64:3 * 64 + 65])


def test_small_blocks_and_an_empty_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "STRIPED_BLOCK", 4096)
    vol = Volume([tmp_path / "a", tmp_path / "b"], stripe="4K")
    docs = _documents(n=30, seed=5)
    write_token_dataset(vol / "small", docs)
    tokens = torch.cat([d.to(torch.int64) for d in docs])
    with TokenDataset(vol / "small", seq_len=33) as ds:
        assert torch.equal(ds[len(ds) - 1], tokens[(len(ds) - 1) * 33:len(ds) * 33 + 1])
    write_token_dataset(vol / "empty", [])
    with TokenDataset(vol / "empty", seq_len=4) as ds:
        assert len(ds) == 0 and ds.num_documents == 0
