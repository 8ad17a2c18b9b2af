"""``deepnvme generate`` at its boundary: the docs' copy of ``--help`` and one-line errors
(exit 2, no traceback) before any model is loaded."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

COMMAND_LINE_DOC = Path(__file__).resolve().parents[3] / "docs" / "command-line.md"


def test_docs_show_the_current_generate_help(run_cli, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal's width
    code, out, _ = run_cli("generate", "--help")
    assert code == 0 and out.startswith("usage: deepnvme generate ")
    blocks = re.findall(r"```text\n\$ deepnvme generate --help\n(.*?)```", COMMAND_LINE_DOC.read_text(),
                        flags=re.S)
    assert blocks == [out], ("docs/command-line.md's 'deepnvme generate --help' block is stale: paste "
                             "`COLUMNS=100 deepnvme generate --help` into it")


def _model_dir(tmp_path: Path) -> str:
    """A folder that passes the --model check (nothing is loaded before the errors tested)."""
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def _one_line_error(code: int, out: str, err: str, message: str) -> None:
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and err.startswith("deepnvme generate: error: "), err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (("--dtype", "float8"), "argument --dtype: unknown dtype 'float8'; use one of"),
    (("--batch-size", "0"), "argument --batch-size: must be >= 1, got 0"),
    (("--prompt-len", "-3"), "argument --prompt-len: must be >= 1, got -3"),
    (("--gen-len", "0"), "argument --gen-len: must be >= 1, got 0"),
    (("--prefetch", "-1"), "argument --prefetch: must be >= 0, got -1"),
    (("--block-size", "0"), "argument --block-size: must be at least 1 byte"),
    (("--block-size=-1M",), "argument --block-size: must be at least 1 byte, got '-1M'"),
    (("--queue-depth", "0"), "argument --queue-depth: must be >= 1, got 0"),
    (("--parallelism", "-2"), "argument --parallelism: must be >= 1, got -2"),
    (("--device", "tpu"), "--device 'tpu' is not a device"),
])
def test_bad_values_are_one_line(run_cli, tmp_path, argv, message) -> None:
    _one_line_error(*run_cli("generate", "--model", _model_dir(tmp_path), *argv), message)


def test_cuda_without_cuda_is_one_line(run_cli, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _one_line_error(*run_cli("generate", "--model", _model_dir(tmp_path), "--device", "cuda:0"),
                    "--device cuda:0 needs CUDA, but torch.cuda.is_available() is False")


def test_missing_transformers_is_one_line(run_cli, monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    _one_line_error(*run_cli("generate", "--model", _model_dir(tmp_path)),
                    "generate needs transformers and accelerate (transformers is missing): "
                    "pip install 'deepnvme[inference]'")


def test_a_hub_id_is_not_downloaded(run_cli, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _one_line_error(*run_cli("generate", "--model", "meta-llama/Llama-3.2-1B"),
                    "--model 'meta-llama/Llama-3.2-1B' is not a local folder")
    _one_line_error(*run_cli("generate", "--model", str(tmp_path)), "has no config.json")


def test_a_hub_id_in_a_real_process_gives_one_line(spawn, tmp_path) -> None:
    proc = spawn("generate", "--model", "no-such-org/no-such-model", cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    _one_line_error(proc.returncode, out, err, "is not a local folder")
