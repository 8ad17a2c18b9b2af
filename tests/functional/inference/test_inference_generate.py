"""run_generate and the generate CLI helper on a tiny checkpoint."""

import argparse
import json

import pytest
import torch
from tiny_transformers import tiny_model

from deepnvme import _deprecation
from deepnvme.cli.generate import add_generate_parser
from deepnvme.errors import UsageError
from deepnvme.inference import GenerateResult, run_generate


def test_run_generate_streamed_equals_memory(tmp_path):
    tiny_model("llama", torch.bfloat16).save_pretrained(tmp_path)
    kw = dict(batch_size=2, prompt_len=5, gen_len=4, seed=3)
    mem = run_generate(str(tmp_path), mode="memory", **kw)
    streamed = run_generate(str(tmp_path), prefetch=2, **kw)
    assert isinstance(streamed, GenerateResult)
    assert streamed.tokens == mem.tokens and len(streamed.tokens) == 2 and len(streamed.tokens[0]) == 4
    assert streamed.dtype == "bfloat16" and streamed.bytes_read > 0 and mem.bytes_read == 0
    assert 0.0 <= streamed.overlap_efficiency <= 1.0
    assert streamed.peak_rss_anon > 0
    assert abs(streamed.total_tokens_per_s - 8 / streamed.total_seconds) < 1e-9
    assert "tokens/s" in streamed.render()


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["generate", *argv])


@pytest.mark.parametrize("flag", ["--packed-dir", "--offload-dir"])
def test_generate_parser_runs_and_prints_json(tmp_path, capsys, flag):
    tiny_model("gpt2", torch.float32).save_pretrained(tmp_path / "m")
    args = _parse("--model", str(tmp_path / "m"), flag, str(tmp_path / "packed"), "--dtype", "bf16",
                  "--batch-size", "2", "--prompt-len", "4", "--gen-len", "3", "--prefetch", "0", "--json")
    assert args.func(args) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["mode"] == "deepnvme" and out["dtype"] == "bfloat16" and out["gen_len"] == 3
    assert out["bytes_read"] > 0 and out["total_tokens_per_s"] > 0
    assert (tmp_path / "packed" / "weights.bin").exists()
    deprecated = "--offload-dir is deprecated" in captured.err and "use --packed-dir" in captured.err
    assert deprecated == (flag == "--offload-dir")


def test_generate_refuses_both_the_old_and_the_new_flag(tmp_path):
    args = _parse("--model", str(tmp_path), "--packed-dir", "a", "--offload-dir", "b")
    with pytest.raises(UsageError, match="--packed-dir only"):
        args.func(args)


def test_run_generate_takes_the_old_keyword_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(_deprecation, "_warned", set())   # the ledger is per process
    tiny_model("gpt2", torch.float32).save_pretrained(tmp_path / "m")
    kw = dict(batch_size=1, prompt_len=3, gen_len=2, dtype="bf16")
    with pytest.warns(DeprecationWarning, match="offload_dir= is deprecated.*packed_dir="):
        old = run_generate(str(tmp_path / "m"), offload_dir=str(tmp_path / "p"), **kw)
    assert (tmp_path / "p" / "weights.bin").exists()
    assert old.tokens == run_generate(str(tmp_path / "m"), packed_dir=str(tmp_path / "p"), **kw).tokens
    with pytest.raises(TypeError, match="both offload_dir="):
        run_generate(str(tmp_path / "m"), offload_dir="a", packed_dir="b")
