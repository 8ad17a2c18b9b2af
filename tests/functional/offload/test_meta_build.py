"""A model built on the meta device and filled tensor by tensor into offloaded storage, from a
safetensors checkpoint (written by the safetensors package itself) or an init function."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import deepnvme
from deepnvme.offload import offload_parameters

from .test_offload_parameters import TinyLM, assert_same, train


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_meta_model_from_a_safetensors_checkpoint_trains_like_the_original(tmp_path):
    torch.manual_seed(0)
    a = TinyLM()
    state = {k: v for k, v in a.state_dict().items() if k != "head.weight"}  # tied: stored once
    save_file(state, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        b = TinyLM()
    off = offload_parameters(b, tmp_path / "swap", max_in_memory_bytes=20_000,
                             source=tmp_path)  # a folder holding model.safetensors
    assert b.head.weight is b.emb.weight and not b.emb.weight.is_meta
    assert_same(a, off)
    assert off.stats().peak_bytes <= 20_000
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt_b = deepnvme.NVMeOptimizer(b.parameters(), torch.optim.AdamW, swap_dir=tmp_path / "swap", lr=1e-2)
    train(a, opt_a, 2, 1)
    train(b, opt_b, 2, 1)
    assert_same(a, off)
    off.close()
    opt_b.close()


def test_meta_model_from_an_init_function_and_meta_buffers(tmp_path):
    with torch.device("meta"):
        m = WithBuffer()
    seen = []

    def init(name, t):
        seen.append(name)
        t.fill_(0.5 if name != "scale" else 3.0)

    off = offload_parameters(m, tmp_path, max_in_memory_bytes=1 << 20, source=init)
    assert sorted(seen) == ["lin.bias", "lin.weight", "scale"]
    assert torch.equal(m(torch.ones(1, 8)), torch.full((1, 8), (8 * 0.5 + 0.5) * 3.0))
    off.close()


def test_meta_model_checkpoint_mismatches_are_named(tmp_path):
    save_file({"lin.weight": torch.zeros(8, 4), "lin.bias": torch.zeros(8), "scale": torch.ones(8)},
              str(tmp_path / "bad.safetensors"))
    with torch.device("meta"):
        m = WithBuffer()
    with pytest.raises(deepnvme.CheckpointMismatchError, match=r"'lin.weight' has shape \[8, 4\]"):
        offload_parameters(m, tmp_path / "s", max_in_memory_bytes=1 << 20, source=tmp_path / "bad.safetensors")
    save_file({"lin.bias": torch.zeros(8)}, str(tmp_path / "missing.safetensors"))
    with pytest.raises(deepnvme.CheckpointMismatchError, match="no tensor named 'lin.weight'"):
        offload_parameters(m, tmp_path / "s", max_in_memory_bytes=1 << 20,
                           source=tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="meta device: pass source="):
        offload_parameters(m, tmp_path / "s", max_in_memory_bytes=1 << 20)


def test_meta_model_from_a_checkpoint_of_another_dtype_is_converted(tmp_path):
    torch.manual_seed(0)
    weight = torch.randn(600, 600).to(torch.bfloat16)      # converted into its own mapping
    save_file({"lin.weight": weight, "lin.bias": torch.ones(600, dtype=torch.bfloat16)},
              str(tmp_path / "bf16.safetensors"))
    with torch.device("meta"):
        m = nn.Sequential()
        m.add_module("lin", nn.Linear(600, 600))
    off = offload_parameters(m, tmp_path / "s", max_in_memory_bytes=4 << 20,
                             source=tmp_path / "bf16.safetensors")
    got = off.parameter("lin.weight")
    assert got.dtype == torch.float32 and torch.equal(got, weight.float())
    assert torch.equal(off.parameter("lin.bias"), torch.ones(600))
    off.close()
