"""Every help screen of the ``deepnvme`` command reads as plain text: no reStructuredText."""

from __future__ import annotations

import argparse
import re

import pytest

from deepnvme.cli import main as cli_main

_MARKUP = re.compile(r"``|:[a-z]+:`|`")


def _parsers(parser: argparse.ArgumentParser, prog: str) -> list[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every subcommand below it (``bench load`` included), by their command line."""
    found = [(prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _parsers(sub, f"{prog} {name}")
    return found


def test_the_walk_reaches_every_command_and_mode() -> None:
    names = {prog for prog, _ in _parsers(cli_main.build_parser(), "deepnvme")}
    assert {"deepnvme", "deepnvme report", "deepnvme bench", "deepnvme bench load",
            "deepnvme bench data", "deepnvme tune", "deepnvme generate", "deepnvme clean",
            "deepnvme plan", "deepnvme verify"} <= names


@pytest.mark.parametrize("prog", [prog for prog, _ in _parsers(cli_main.build_parser(), "deepnvme")])
def test_help_has_no_restructuredtext(prog, run_cli) -> None:
    code, out, err = run_cli(*prog.split()[1:], "--help")
    assert code == 0 and err == "", err
    assert out.startswith("usage: ")
    found = [line for line in out.splitlines() if _MARKUP.search(line)]
    assert not found, f"{prog} --help shows markup: {found}"


def test_help_keeps_the_words_the_markup_wrapped(run_cli) -> None:
    _, out, _ = run_cli("plan", "--help")
    assert "sqrt(2 C M)" in out and "--checkpoint PATH" in out
    _, out, _ = run_cli("--help")
    assert "deepnvme clean DIR removes those" in " ".join(out.split())
