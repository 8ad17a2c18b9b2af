"""Every size and count option of bench, tune and generate: zero or negative is one line on
stderr, exit 2, no traceback, and nothing is measured."""

from __future__ import annotations

import pytest

from deepnvme.cli import main as cli_main

# (command, option, lowest accepted value): every size/count option the parsers define
BOUNDS = [
    ("bench", "--io-size", 1), ("bench", "--block-size", 1), ("bench", "--queue-depth", 1),
    ("bench", "--parallelism", 1), ("bench", "--random-size", 1), ("bench", "--loops", 1),
    ("bench", "--warmup-loops", 0), ("bench", "--procs", 1),
    ("tune", "--io-size", 1), ("tune", "--loops", 1), ("tune", "--load-size", 1), ("tune", "--load-rounds", 1),
    ("generate", "--batch-size", 1), ("generate", "--prompt-len", 1),
    ("generate", "--gen-len", 1), ("generate", "--prefetch", 0),
    ("generate", "--block-size", 1), ("generate", "--queue-depth", 1),
    ("generate", "--parallelism", 1), ("generate", "--group-size", 1),
]


def _typed_options(command: str) -> set[str]:
    """Options of ``command`` whose values are whole numbers or sizes (type int or a check)."""
    parser = cli_main.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {a.option_strings[-1] for a in sub._actions
            if a.type is not None and getattr(a.type, "__name__", "") in (
                "int", "parse_size", "positive_int", "nonnegative_int", "positive_size")
            and a.dest != "seed"}


def test_the_table_names_every_count_and_size_option() -> None:
    for command in ("bench", "tune", "generate"):
        listed = {opt for cmd, opt, _ in BOUNDS if cmd == command}
        assert _typed_options(command) == listed, command


@pytest.mark.parametrize("command, option, low", BOUNDS)
def test_below_the_bound_is_one_line_exit_2(run_cli, monkeypatch, tmp_path, command, option,
                                            low) -> None:
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured despite a bad argument")

    for name in ("run_bench", "run_tune", "run_generate"):
        monkeypatch.setattr(f"deepnvme.cli.{name[4:]}.{name}", no_measuring)
    for bad in (low - 1, -5):
        code, out, err = run_cli(command, f"{option}={bad}", "--dir", str(tmp_path)) \
            if command != "generate" else run_cli(command, f"{option}={bad}", "--model", ".")
        assert code == 2 and out == "", err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert err.startswith(f"deepnvme {command}: error: argument {option}: must be"), err


def test_tune_budget_must_be_positive(run_cli, tmp_path) -> None:
    for bad in ("0", "-1", "nan", "soon"):
        code, out, err = run_cli("tune", "--dir", str(tmp_path), f"--budget={bad}")
        assert code == 2 and out == "" and err.count("\n") == 1
        assert err.startswith("deepnvme tune: error: argument --budget: "), err


def test_bench_gpu_without_cuda_is_one_line(run_cli, monkeypatch, leftovers, tmp_path) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_cli("bench", "--gpu", "--dir", str(tmp_path), "--io-size", "1M")
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("deepnvme bench: error: --gpu needs a CUDA device"), err
    assert leftovers(tmp_path) == []
