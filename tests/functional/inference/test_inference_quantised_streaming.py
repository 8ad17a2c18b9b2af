"""Streaming with int8/int4 group-quantised block weights: accuracy, bytes read, settings kept apart."""

import argparse
import json
import os

import pytest
import torch
from tiny_transformers import prompt, tiny_model

import deepnvme.inference as inf
from deepnvme.cli.generate import add_generate_parser
from deepnvme.errors import UsageError
from deepnvme.inference._packed import MANIFEST_FILE

# logits error of the tiny models (weights ~N(0, 0.02), hidden 64) with group size 32: measured
# int8 <= 0.008, int4 <= 0.09 max; bounds leave ~3x margin and are far below a broken dequantiser (~1)
_MAX_ERR = {"int8": 0.03, "int4": 0.3}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_stream_weights_quantised_is_close_and_reads_fewer_bytes(tmp_path, arch, mode):
    ids = prompt()
    ref = _logits(tiny_model(arch, torch.bfloat16), ids)
    plain = inf.stream_weights(tiny_model(arch, torch.bfloat16), str(tmp_path / "plain"))
    assert torch.equal(_logits(plain, ids), ref)
    plain_bytes = inf.stream_stats(plain).bytes_read
    model = inf.stream_weights(tiny_model(arch, torch.bfloat16), str(tmp_path / mode), quantize=mode,
                               group_size=32, prefetch=2)
    out = _logits(model, ids)
    err = (out - ref).abs()
    assert 0 < float(err.max()) < _MAX_ERR[mode]
    assert float(err.mean()) < _MAX_ERR[mode] / 4
    stats = inf.stream_stats(model)
    assert stats.bytes_read < plain_bytes * (0.75 if mode == "int8" else 0.55)
    assert stats.dequant_seconds > 0
    # the streamed parameters are back to 1-element placeholders of the compute dtype between uses
    lin = next(m for m in model.modules() if type(m).__name__ in ("Linear", "Conv1D") and m.weight.dim() == 2
               and m.weight.stride() == (0, 0))
    assert lin.weight.dtype == torch.bfloat16
    manifest = json.loads((tmp_path / mode / MANIFEST_FILE).read_text())
    assert manifest["setting"] == {"quantize": mode, "group_size": 32, "dtype": "bfloat16"}
    assert json.loads((tmp_path / "plain" / MANIFEST_FILE).read_text())["setting"] is None
    inf.streamer_of(model).close()
    inf.streamer_of(plain).close()


def test_old_names_take_the_new_keywords(tmp_path):
    ids = prompt()
    with pytest.warns(DeprecationWarning):
        offload = inf.offload
    model = offload(tiny_model("llama", torch.float32), str(tmp_path / "a"), quantize="int8", group_size=64)
    assert float((_logits(model, ids) - _logits(tiny_model("llama", torch.float32), ids)).abs().max()) < 0.03
    inf.streamer_of(model).close()
    tiny_model("llama", torch.float32).save_pretrained(tmp_path / "ckpt")
    with pytest.warns(DeprecationWarning):
        load_offloaded = inf.load_offloaded
    model = load_offloaded(str(tmp_path / "ckpt"), packed_dir=str(tmp_path / "b"), quantize="int4", group_size=16)
    assert json.loads((tmp_path / "b" / MANIFEST_FILE).read_text())["setting"]["quantize"] == "int4"
    inf.streamer_of(model).close()


def test_load_streamed_never_reuses_a_copy_made_for_another_setting(tmp_path):
    ckpt, packed = tmp_path / "ckpt", tmp_path / "packed"
    ref_model = tiny_model("llama", torch.float32)
    ref_model.save_pretrained(ckpt)
    ids = prompt()
    ref = _logits(ref_model, ids)
    seen = {}
    for quantize, group in [("int8", 32), ("int8", 32), ("int4", 32), ("int8", 16), (None, None), ("int4", 32)]:
        model = inf.load_streamed(str(ckpt), packed_dir=str(packed), dtype=torch.bfloat16, quantize=quantize,
                                  group_size=group)
        out = _logits(model, ids)
        inf.streamer_of(model).close()
        stamp = os.stat(packed / "weights.bin").st_mtime_ns
        setting = json.loads((packed / MANIFEST_FILE).read_text())["setting"]
        expected = None if quantize is None else {"quantize": quantize, "group_size": group, "dtype": "bfloat16"}
        assert setting == expected
        key = (quantize, group)
        if key in seen:
            assert torch.equal(out, seen[key][0])       # the same setting reads the same stored values
        seen[key] = (out, stamp)
        bound = 0.05 if quantize is None else _MAX_ERR[quantize]   # bf16 vs the float32 reference
        assert float((out - ref).abs().max()) < bound
    stamps = [s for _, s in seen.values()]
    assert len(set(stamps)) == len(stamps)               # every change of setting rewrote the copy
    assert not torch.equal(seen["int8", 32][0], seen["int8", 16][0])


def test_load_streamed_errors_name_the_setting_and_the_tensor(tmp_path):
    tiny_model("llama", torch.float32).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="pass packed_dir="):
        inf.load_streamed(str(tmp_path / "ckpt"), quantize="int8")
    with pytest.raises(ValueError, match=r"group_size 48 does not divide the input dimension 64 of "
                                         r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        inf.load_streamed(str(tmp_path / "ckpt"), packed_dir=str(tmp_path / "p"), quantize="int4", group_size=48)
    assert not (tmp_path / "p").exists()                  # checked before anything is written
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        inf.stream_weights(tiny_model("opt", torch.float32), str(tmp_path / "q"), quantize="int8", group_size=-4)


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["generate", *argv])


def test_generate_with_quantize_runs_and_reports_it(tmp_path, capsys):
    tiny_model("gpt2", torch.bfloat16).save_pretrained(tmp_path / "m")
    common = ("--model", str(tmp_path / "m"), "--batch-size", "1", "--prompt-len", "4", "--gen-len", "3")
    args = _parse(*common, "--packed-dir", str(tmp_path / "p"), "--quantize", "int4", "--group-size", "32", "--json")
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["quantize"] == "int4" and out["group_size"] == 32 and out["dequant_seconds"] > 0
    text = inf.run_generate(str(tmp_path / "m"), packed_dir=str(tmp_path / "p"), quantize="int8", group_size=64,
                            batch_size=1, prompt_len=4, gen_len=2).render()
    assert "weights int8 (group 64)" in text and "dequantising" in text
    for argv, message in [(("--quantize", "int8"), "give --packed-dir"),
                          (("--group-size", "64"), "--group-size applies only with --quantize"),
                          (("--mode", "memory", "--quantize", "int8", "--packed-dir", "x"), "needs --mode deepnvme")]:
        args = _parse(*common, *argv)
        with pytest.raises(UsageError, match=message):
            args.func(args)


def test_quantised_blocks_run_under_inference_mode_and_the_arena_is_reused(tmp_path):
    ids = prompt()
    model = inf.stream_weights(tiny_model("llama", torch.bfloat16), str(tmp_path / "q"), quantize="int4",
                               group_size=16, pin_memory=False)
    expected = _logits(model, ids)
    with torch.inference_mode():
        first = model(ids).logits.float()
        second = model(ids).logits.float()
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert _logits(model, ids).equal(expected)            # buffers made inside inference_mode still work
    streamer = inf.streamer_of(model)
    arena = streamer._arena
    assert arena is not None and arena.numel() == streamer._arena_bytes   # one block's dequantised weights
    streamer.close()
