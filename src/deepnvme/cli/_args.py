"""The ``deepnvme`` parser and its argument checks: a bad value is one line on stderr and exit 2.

Values are checked when parsed (sizes and counts must be positive), so a mistake is reported
before anything is allocated or measured; :class:`UsageError` is for checks that need more
than one value or the system (a device, an optional package, a path).
"""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

from ..bench._files import check_writable
from ..config import parse_size
from ..errors import ConfigError, UsageError

__all__ = ["UsageError", "CliParser", "positive_int", "nonnegative_int", "positive_size",
           "positive_float", "check_writable", "plain_text", "plain_help"]

# reStructuredText in docstrings reused as help: double-backquoted literals and roles
_LITERAL = re.compile(r"``(.+?)``", re.S)
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+?)`")


class CliParser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument is one line (``deepnvme bench: error: ...``)
    instead of the usage block, so the mistake is the first thing read."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    """A count that must be at least 1 (loops, processes, queue depth ...)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """A count that may be 0 (warm-up loops, prefetched blocks)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_size(text: str) -> int:
    """A byte size with an optional K/M/G/T suffix, at least 1 byte."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    try:
        value = parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A number of seconds (or similar) that must be above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def plain_text(text: str) -> str:
    """``text`` without reStructuredText markup, so a docstring reads as plain help: literals
    lose their double backquotes, a role keeps its target (only the last name after a ``~``)."""
    def role(m: re.Match[str]) -> str:
        return m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)

    return _LITERAL.sub(r"\1", _ROLE.sub(role, text))


def plain_help(parser: argparse.ArgumentParser) -> None:
    """Strip reStructuredText from the description, epilog and every option's help of
    ``parser`` and of its subcommands, recursively (the help is read in a terminal)."""
    for field in ("description", "epilog"):
        if getattr(parser, field):
            setattr(parser, field, plain_text(getattr(parser, field)))
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = plain_text(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if isinstance(choice.help, str):
                    choice.help = plain_text(choice.help)
            for sub in dict.fromkeys(action.choices.values()):
                plain_help(sub)
