"""Token batches on a CUDA machine: pinned batches are pinned in CUDA's sense and reach the GPU
intact with non-blocking copies. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from deepnvme.data import TokenDataset, write_token_dataset

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_pinned_batches_copy_to_the_gpu(tmp_path):
    docs = [torch.randint(0, 30000, (n,)) for n in (500, 1, 900, 333)]
    write_token_dataset(tmp_path / "c", docs)
    ds = TokenDataset(tmp_path / "c", seq_len=31)
    tokens = torch.cat(docs)
    order = torch.randperm(len(ds)).tolist()
    seen = []
    for batch in ds.batches(order, 8, pin_memory=True):
        assert batch.is_pinned()
        seen.append(batch.to("cuda", non_blocking=True))
    torch.cuda.synchronize()
    want = torch.stack([tokens[i * 31:i * 31 + 32] for i in order])
    assert torch.equal(torch.cat(seen).cpu(), want)


def test_batches_on_the_gpu(tmp_path):
    docs = [torch.randint(0, 30000, (n,)) for n in (700, 2, 1200)]
    write_token_dataset(tmp_path / "c", docs)
    ds = TokenDataset(tmp_path / "c", seq_len=31)
    tokens = torch.cat(docs)
    order = torch.randperm(len(ds)).tolist()
    got = list(ds.batches(order, 8, device="cuda"))
    assert all(b.is_cuda for b in got)
    want = torch.stack([tokens[i * 31:i * 31 + 32] for i in order])
    assert torch.equal(torch.cat(got).cpu(), want)
