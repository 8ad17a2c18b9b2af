"""Swapping to a Volume: TensorSwapper, NVMeOptimizer and offload_parameters stripe their
files over every drive and clean up every drive."""

from __future__ import annotations

import os

import torch

import deepnvme
from deepnvme import Volume
from deepnvme.optim import NVMeOptimizer
from deepnvme.swap import TensorSwapper

from ...conftest import random_tensor, same_bytes
from ..optim.test_nvme_optimizer import make_model, same_params, same_state, train


def _volume(tmp_path):
    return Volume([tmp_path / "d0", tmp_path / "d1"], stripe="4K")


def test_swapper_stripes_keys_and_cleans_every_drive(tmp_path):
    vol = _volume(tmp_path)
    tensors = {k: random_tensor(20_000 + 4099 * k, seed=k) for k in range(4)}
    with TensorSwapper(vol, buffer_bytes=1 << 20, buffer_count=2, min_swap_bytes=1) as sw:
        assert sw.volume is not None and len(sw.volume.paths) == 2
        for k, t in tensors.items():
            sw.swap_out(k, t).result()
        privates = sw.volume.paths
        for d, private in enumerate(privates):
            parts = sorted(f for f in os.listdir(private) if f.endswith(f".part{d}"))
            assert parts == sorted(f"{k}.swp.part{d}" for k in tensors)
        for k, t in tensors.items():
            back = torch.empty_like(t)
            sw.swap_in(k, out=back).result()
            assert same_bytes(back, t)
        piece = torch.empty(5000, dtype=torch.uint8)
        sw.swap_in_range(1, piece, 4000).result()
        assert same_bytes(piece, deepnvme.cast_to_byte_tensor(tensors[1])[4000:9000])
        sw.discard(0)
        assert not any(f.startswith("0.swp") for p in privates for f in os.listdir(p))
    assert not any(os.path.exists(p) for p in privates)
    assert not os.path.exists(tmp_path / "d0") and not os.path.exists(tmp_path / "d1")


def test_nvme_optimizer_on_a_volume_equals_in_memory(tmp_path):
    ref, off = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with NVMeOptimizer(off.parameters(), torch.optim.AdamW, swap_dir=_volume(tmp_path),
                       sub_group_bytes=8 << 10, lr=1e-2) as opt:
        train(ref, ref_opt, 3)
        train(off, opt, 3)
        assert same_params(ref, off)
        assert same_state(ref_opt.state_dict(), opt.state_dict())


def test_offload_parameters_on_a_volume(tmp_path):
    a, b = make_model(), make_model()
    off = deepnvme.offload_parameters(b, _volume(tmp_path), max_in_memory_bytes=30_000)
    try:
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(a(x), b(x))
        on_d1 = [f for _, _, files in os.walk(tmp_path / "d1") for f in files]
        assert any(f.endswith(".swp.part1") for f in on_d1), on_d1
    finally:
        off.close()
