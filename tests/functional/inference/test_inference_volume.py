"""Weight streaming from an aligned copy striped over a volume: stream_weights, load_streamed
(also quantised) and the vLLM-style options' list of directories."""

from __future__ import annotations

import json
import logging
import os

import torch
from tiny_transformers import greedy, prompt, tiny_model
from torch import nn

import deepnvme.inference as inf
from deepnvme import Volume
from deepnvme.integrations._layer_stream import stream_options


def test_stream_weights_reads_each_block_from_every_drive(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)]).eval()
    x = torch.randn(5, 64)
    with torch.no_grad():
        expected = model(x)
    vol = Volume([tmp_path / "d0", tmp_path / "d1"], stripe="4K")   # a block spans both drives
    inf.stream_weights(model, vol, blocks=list(model), prefetch=1)
    assert os.path.exists(tmp_path / "d0" / "manifest.json")
    sizes = [os.path.getsize(tmp_path / d / f"weights.bin.part{i}") for i, d in enumerate(("d0", "d1"))]
    assert min(sizes) > 0 and abs(sizes[0] - sizes[1]) <= 4096
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert inf.stream_stats(model).blocks_loaded == 8
    inf.streamer_of(model).close()


def test_load_streamed_on_a_volume_reuses_the_copy_and_rewrites_for_other_drives(tmp_path, caplog):
    ckpt = tmp_path / "ckpt"
    ref = tiny_model("llama", torch.float32)
    ref.save_pretrained(ckpt)
    vol = Volume([tmp_path / "a", tmp_path / "b"], stripe="16K")
    ids = prompt()
    model = inf.load_streamed(str(ckpt), packed_dir=vol)
    assert torch.equal(greedy(model, ids), greedy(ref, ids))
    inf.streamer_of(model).close()
    first = os.stat(tmp_path / "a" / "weights.bin.part0").st_mtime_ns
    inf.streamer_of(inf.load_streamed(str(ckpt), packed_dir=vol)).close()
    assert os.stat(tmp_path / "a" / "weights.bin.part0").st_mtime_ns == first   # reused
    other = Volume([tmp_path / "a", tmp_path / "b"], stripe="4K")    # another stripe unit
    with caplog.at_level(logging.INFO, logger="deepnvme"):
        model = inf.load_streamed(str(ckpt), packed_dir=other)
    assert "cannot be used" in caplog.text
    assert torch.equal(greedy(model, ids), greedy(ref, ids))
    inf.streamer_of(model).close()
    q = inf.load_streamed(str(ckpt), packed_dir=Volume([tmp_path / "q0", tmp_path / "q1"]),
                          quantize="int8", group_size=32)
    assert greedy(q, ids).shape == greedy(ref, ids).shape
    assert json.loads((tmp_path / "q0" / "manifest.json").read_text())["setting"]["quantize"] == "int8"
    inf.streamer_of(q).close()


def test_vllm_options_take_a_list_of_directories_as_a_volume(tmp_path):
    opts = stream_options({"packed_dir": [str(tmp_path / "d0"), str(tmp_path / "d1")]}, load_format="x")
    assert opts.packed_dir == Volume([tmp_path / "d0", tmp_path / "d1"])
