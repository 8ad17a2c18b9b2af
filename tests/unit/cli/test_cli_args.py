"""The CLI's argument types, output-path check and one-line parser errors."""

from __future__ import annotations

import argparse
import os

import pytest

from deepnvme.cli._args import (
    CliParser,
    UsageError,
    check_writable,
    nonnegative_int,
    plain_text,
    positive_float,
    positive_int,
    positive_size,
)
from deepnvme.cli.bench import parse_dir_map
from deepnvme.errors import ConfigError


def test_counts_and_sizes() -> None:
    assert positive_int("3") == 3 and nonnegative_int("0") == 0
    assert positive_size("4K") == 4096 and positive_size("1") == 1
    assert positive_float("0.5") == 0.5
    for func, text, message in [
        (positive_int, "0", "must be >= 1, got 0"), (positive_int, "1.5", "whole number"),
        (nonnegative_int, "-1", "must be >= 0, got -1"),
        (positive_size, "0K", "must be at least 1 byte"),
        (positive_size, "-4K", "must be at least 1 byte, got '-4K'"),
        (positive_size, "lots", "cannot parse size 'lots'"),
        (positive_float, "0", "must be > 0"), (positive_float, "nan", "must be > 0"),
        (positive_float, "x", "expected a number"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            func(text)


def test_parser_error_is_one_line(capsys) -> None:
    parser = CliParser(prog="deepnvme x")
    parser.add_argument("--n", type=positive_int)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--n", "0"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == ("deepnvme x: error: argument --n: must be >= 1, got 0 "
                                       "(see 'deepnvme x --help')\n")


def test_check_writable(tmp_path) -> None:
    check_writable(str(tmp_path / "new.json"), "--output", force=False)
    existing = tmp_path / "old.json"
    existing.write_text("x")
    check_writable(str(existing), "--output")  # force (the default): may be overwritten
    with pytest.raises(UsageError, match="already exists; add --force"):
        check_writable(str(existing), "--output", force=False)
    with pytest.raises(UsageError, match="is a directory"):
        check_writable(str(tmp_path), "--output")
    with pytest.raises(UsageError, match="does not exist"):
        check_writable(str(tmp_path / "a" / "b.json"), "--output")
    if os.geteuid() != 0:  # root writes through permission bits
        existing.chmod(0o444)
        with pytest.raises(UsageError, match="is not writable"):
            check_writable(str(existing), "--output")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]  # no probe file left


def test_parse_dir_map() -> None:
    assert parse_dir_map("/a:0,/b:c:1") == (("/a", "/b:c"), (0, 1))
    for bad in ("/a", "/a:x", ":1", ""):
        with pytest.raises(ConfigError):
            parse_dir_map(bad)


def test_plain_text_drops_restructuredtext_markup() -> None:
    text = ("``deepnvme bench``: see :func:`~deepnvme.bench.run_bench`, :mod:`deepnvme.bench` and\n"
            "``sqrt(2 C M)`` across\nlines ``a\nb``; 'quotes' and {\"aio\": 1} stay")
    assert plain_text(text) == ("deepnvme bench: see run_bench, deepnvme.bench and\n"
                                "sqrt(2 C M) across\nlines a\nb; 'quotes' and {\"aio\": 1} stay")
