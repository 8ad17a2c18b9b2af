"""``deepnvme bench data PREFIX`` run for real on a tiny token dataset (fadvise eviction)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch

from deepnvme.bench import _data_readers
from deepnvme.data import write_token_dataset

FAST = ("--seq-len", "16", "--batch-size", "4", "--shuffled", "20", "--sequential", "30",
        "--evict", "fadvise")


@pytest.fixture
def corpus(tmp_path):
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 50000, (int(n),), generator=g) for n in torch.randint(1, 90, (40,), generator=g)]
    prefix = str(tmp_path / "tok")
    write_token_dataset(prefix, docs)
    return prefix, torch.cat(docs)


def _expected_sum(tokens, order, n=16):
    return sum(int(tokens[i * n:i * n + n + 1].sum()) for i in order)


def test_json_rows_and_checksums(run_cli, corpus):
    prefix, tokens = corpus
    code, out, err = run_cli("bench", "data", prefix, *FAST, "--reps", "2", "--json")
    assert code == 0, err
    data = json.loads(out)
    readers = ["deepnvme", "np.memmap"]
    if importlib.util.find_spec("megatron") is not None:
        readers.insert(1, "megatron-core")
    assert [(r["order"], r["reader"]) for r in data["rows"]] == [(o, r) for o in ("shuffled", "sequential")
                                                                  for r in readers]
    count = (len(tokens) - 1) // 16
    orders = _data_readers.sample_orders(count, shuffled=20, sequential=30, seed=0)
    for row in data["rows"]:
        assert len(row["runs"]) == 2 and row["samples"] == len(orders[row["order"]])
        assert {r["checksum"] for r in row["runs"]} == {_expected_sum(tokens, orders[row["order"]])}
        assert row["samples_per_s"]["median"] > 0 and row["sample_bytes"] == 17 * 2
        if row["reader"] == "deepnvme":
            assert row["deepnvme_vs_np.memmap"] > 0
    assert data["eviction"] == "fadvise"


def test_table(run_cli, corpus):
    code, out, _err = run_cli("bench", "data", corpus[0], *FAST, "--reps", "1", "--readers", "deepnvme,np.memmap")
    assert code == 0
    assert "deepnvme / reader" in out and "np.memmap" in out and "torch threads: 1" in out


def test_readers_that_disagree_are_an_error(run_cli, corpus, monkeypatch):
    wrong = dataclasses.replace(_data_readers.DATA_READERS["np.memmap"], read=lambda *a: 42)
    monkeypatch.setitem(_data_readers.DATA_READERS, "np.memmap", wrong)
    with pytest.raises(RuntimeError, match="the readers disagree"):
        run_cli("bench", "data", corpus[0], *FAST, "--reps", "1", "--readers", "deepnvme,np.memmap")


def test_usage_errors(run_cli, corpus):
    code, _out, err = run_cli("bench", "data", corpus[0], *FAST, "--readers", "mmap2")
    assert code == 2 and "unknown reader(s) mmap2" in err
    code, _out, err = run_cli("bench", "data", corpus[0], "--seq-len", "100000", "--evict", "fadvise")
    assert code == 2 and "hold no sample" in err
