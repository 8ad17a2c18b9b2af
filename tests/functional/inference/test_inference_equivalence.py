"""Streamed models produce the in-memory model's logits and greedy tokens exactly."""

import pytest
import torch
from tiny_transformers import greedy, prompt, tiny_model

import deepnvme.inference as inf

ARCHS = ("llama", "gpt2", "opt")
DTYPES = (torch.float32, torch.bfloat16)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _check(model, arch, dtype, checkpoints):
    _, ref_logits, ref_tokens = checkpoints[arch, dtype]
    ids = prompt()
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == dtype
    torch.testing.assert_close(logits, ref_logits, **TOL[dtype])
    assert torch.equal(greedy(model, ids), ref_tokens)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_load_streamed_matches_in_memory(arch, dtype, prefetch, checkpoints):
    directory = checkpoints[arch, dtype][0]
    model = inf.load_streamed(directory, prefetch=prefetch)
    try:
        _check(model, arch, dtype, checkpoints)
        stats = inf.stream_stats(model)
        assert stats.blocks_loaded == 3 * 7          # 3 blocks x (1 forward + 6 generate steps)
        assert stats.bytes_read >= stats.blocks_loaded * 64 * 64 * dtype.itemsize
        assert stats.discarded_prefetches == 0
    finally:
        inf.streamer_of(model).close()


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_stream_weights_matches_in_memory(arch, dtype, prefetch, checkpoints, tmp_path):
    model = inf.stream_weights(tiny_model(arch, dtype), str(tmp_path), prefetch=prefetch)
    try:
        _check(model, arch, dtype, checkpoints)
    finally:
        inf.streamer_of(model).close()


@pytest.mark.parametrize("arch", ARCHS)
def test_aligned_copy_converts_dtype(arch, checkpoints, tmp_path):
    """fp32 checkpoint streamed as bf16 via an aligned copy equals the in-memory bf16 cast."""
    directory = checkpoints[arch, torch.float32][0]
    ref = tiny_model(arch, torch.float32).to(torch.bfloat16)
    model = inf.load_streamed(directory, packed_dir=str(tmp_path), dtype=torch.bfloat16, prefetch=1)
    ids = prompt()
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, **TOL[torch.bfloat16])
        assert torch.equal(greedy(model, ids), greedy(ref, ids))
    finally:
        inf.streamer_of(model).close()
