"""Streaming mechanics: memory release, layouts, ties, eviction, errors, recovery."""

import json
import os

import pytest
import torch
from tiny_transformers import greedy, prompt, tiny_model
from torch import nn

import deepnvme.inference as inf
from deepnvme.errors import DeepNVMeError, DeepNVMeIOError


class Stack(nn.Module):
    """A plain torch model: resident embedding and head around streamed MLP blocks."""

    def __init__(self, n=4, width=32):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU(),
                                                  nn.LayerNorm(width)) for _ in range(n))
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.out(x)


def _stack():
    torch.manual_seed(0)
    model = Stack().eval()
    ref = Stack().eval()
    ref.load_state_dict(model.state_dict())
    return model, ref


def test_plain_module_releases_memory_and_writes_aligned_file(tmp_path):
    model, ref = _stack()
    x = torch.randn(5, 8)
    inf.stream_weights(model, str(tmp_path), prefetch=1)
    size = os.path.getsize(tmp_path / "weights.bin")
    assert size % 4096 == 0 and size >= 4 * (32 * 32 + 3 * 32) * 4
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [b["file_offset"] % 4096 for b in manifest["blocks"]] == [0, 0, 0, 0]
    for p in model.blocks.parameters():          # placeholders: one element of storage each
        assert p.untyped_storage().nbytes() <= p.element_size() and not p.requires_grad
    assert model.inp.weight.untyped_storage().nbytes() == 8 * 32 * 4   # resident
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    for p in model.blocks.parameters():
        assert p.untyped_storage().nbytes() <= p.element_size()
    stats = inf.stream_stats(model)
    assert stats.blocks_loaded == 12 and stats.bytes_read == 12 * 8192   # 4480 B per block, aligned
    inf.streamer_of(model).close()


def test_blocks_called_out_of_order_evict_stale_prefetches(tmp_path):
    model, ref = _stack()
    inf.stream_weights(model, str(tmp_path), prefetch=2)
    h = torch.randn(5, 32)
    with torch.no_grad():
        for i in (3, 0, 2, 2, 1, 3):
            torch.testing.assert_close(model.blocks[i](h), ref.blocks[i](h), rtol=0, atol=0)
    assert inf.stream_stats(model).discarded_prefetches > 0
    inf.streamer_of(model).close()


def test_explicit_blocks_and_unpinned_buffers(tmp_path):
    model, ref = _stack()
    inf.stream_weights(model, str(tmp_path), blocks=[model.blocks[1], model.blocks[2]], pin_memory=False)
    assert model.blocks[0][0].weight.untyped_storage().nbytes() == 32 * 32 * 4
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="not submodules"):
        inf.stream_weights(Stack(), str(tmp_path / "x"), blocks=[nn.Linear(1, 1)])
    with pytest.raises(ValueError, match="already streams"):
        inf.stream_weights(model, str(tmp_path))
    inf.streamer_of(model).close()


def test_exception_inside_a_block_does_not_break_the_next_forward(tmp_path):
    model, ref = _stack()
    inf.stream_weights(model, str(tmp_path), prefetch=1)
    x = torch.randn(2, 8)
    with torch.no_grad(), pytest.raises(RuntimeError):
        model.blocks[1](torch.randn(2, 31))   # raises inside block 1 while its weights are bound
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    inf.streamer_of(model).close()


def test_read_error_names_the_file_and_the_model_recovers(tmp_path):
    model, ref = _stack()
    inf.stream_weights(model, str(tmp_path), prefetch=0)
    path = tmp_path / "weights.bin"
    data = path.read_bytes()
    path.write_bytes(data[: 2 * 4096])          # blocks 2 and 3 are gone
    x = torch.randn(2, 8)
    with torch.no_grad(), pytest.raises(DeepNVMeIOError) as info:
        model(x)
    assert "weights.bin" in str(info.value) and info.value.offset == 2 * 4096
    path.write_bytes(data)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    inf.streamer_of(model).close()


def test_gpt2_tied_head_stays_resident_and_shared(tmp_path):
    model = inf.stream_weights(tiny_model("gpt2", torch.float32), str(tmp_path))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.untyped_storage().nbytes() == 128 * 64 * 4
    inf.streamer_of(model).close()


def test_sharded_checkpoint_streams_across_files(tmp_path):
    ref = tiny_model("llama", torch.float32)
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = inf.load_streamed(str(tmp_path), prefetch=1)
    ids = prompt()
    assert torch.equal(greedy(model, ids), greedy(ref, ids))
    inf.streamer_of(model).close()


def test_aligned_copy_is_prepared_once_and_redone_when_the_checkpoint_changes(tmp_path):
    ckpt, off = tmp_path / "ckpt", tmp_path / "off"
    tiny_model("opt", torch.float32).save_pretrained(ckpt)
    inf.streamer_of(inf.load_streamed(str(ckpt), packed_dir=str(off))).close()
    first = os.stat(off / "weights.bin").st_mtime_ns
    inf.streamer_of(inf.load_streamed(str(ckpt), packed_dir=str(off))).close()
    assert os.stat(off / "weights.bin").st_mtime_ns == first       # reused
    ref = tiny_model("opt", torch.float32, seed=5)
    ref.save_pretrained(ckpt)
    model = inf.load_streamed(str(ckpt), packed_dir=str(off))
    assert os.stat(off / "weights.bin").st_mtime_ns != first       # rewritten
    ids = prompt()
    assert torch.equal(greedy(model, ids), greedy(ref, ids))
    inf.streamer_of(model).close()


def test_checkpoint_errors_tell_the_fix(tmp_path):
    tiny_model("llama", torch.float32).save_pretrained(tmp_path)
    with pytest.raises(DeepNVMeError, match="packed_dir"):
        inf.load_streamed(str(tmp_path), dtype=torch.bfloat16)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DeepNVMeError, match="safetensors"):
        inf.load_streamed(str(empty))
    index = tmp_path / "model.safetensors.index.json"
    for f in tmp_path.glob("*.safetensors"):
        from safetensors.torch import load_file, save_file
        tensors = load_file(f)
        tensors.pop("model.layers.1.mlp.up_proj.weight")
        save_file(tensors, f, metadata={"format": "pt"})
    assert not index.exists()
    with pytest.raises(DeepNVMeError, match="up_proj"):
        inf.load_streamed(str(tmp_path))


def test_inference_mode_and_ties_inside_and_across_blocks(tmp_path):
    model, ref = _stack()
    for m in (model, ref):
        m.blocks[1][0].weight = m.blocks[0][0].weight     # across blocks: stays resident
        m.blocks[2][2].weight = m.blocks[2][2].bias       # inside block 2: streamed once
    inf.stream_weights(model, str(tmp_path), prefetch=1)
    assert model.blocks[1][0].weight is model.blocks[0][0].weight
    assert model.blocks[0][0].weight.untyped_storage().nbytes() == 32 * 32 * 4
    assert model.blocks[2][2].weight is model.blocks[2][2].bias
    x = torch.randn(3, 8)
    with torch.inference_mode():
        for _ in range(2):
            torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    inf.streamer_of(model).close()
