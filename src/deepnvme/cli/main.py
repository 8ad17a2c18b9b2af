"""deepnvme: check the environment (report), measure the storage path (bench), pick handle
settings (tune), time generation with weights streamed from disk (generate), plan and verify
checkpoints (plan, verify).

Exit codes: 0 success; 1 ``report`` found a FAIL or ``verify`` a corrupt checkpoint; 2 a usage,
configuration or I/O error (one line on stderr that says what to change; no command at all
prints this help there), or ``verify`` found no checkpoint; 130 interrupted (Ctrl-C, SIGINT);
143 terminated (SIGTERM). Temporary files are removed on either signal; ``deepnvme clean DIR``
removes those of killed (SIGKILL) processes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from .._version import __version__
from ..errors import DeepNVMeError
from ._args import CliParser, plain_help
from .bench import add_bench_parser
from .clean import add_clean_parser
from .generate import add_generate_parser
from .plan import add_plan_parser
from .report import add_report_parser
from .tune import add_tune_parser
from .verify import add_verify_parser
from .volume import add_volume_parser

__all__ = ["main", "build_parser", "SUBCOMMANDS"]

# Each function registers one subcommand on the argparse subparsers object and sets
# ``func`` (args -> exit code) as its default. Add a subcommand by appending its function.
SUBCOMMANDS: list[Callable[[Any], Any]] = [add_report_parser, add_bench_parser, add_tune_parser,
                                          add_generate_parser, add_clean_parser, add_plan_parser,
                                          add_verify_parser, add_volume_parser]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so every ``finally`` removes its files."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"signal {signum}")


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While the command runs, SIGTERM raises :class:`Terminated` (restored afterwards).

    Only the command line does this; the library never installs signal handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def build_parser() -> argparse.ArgumentParser:
    """The ``deepnvme`` parser with every subcommand of :data:`SUBCOMMANDS` registered."""
    parser = CliParser(prog="deepnvme", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"deepnvme {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in SUBCOMMANDS:
        register(sub)
    plain_help(parser)  # docstrings reused as help lose their reStructuredText markup
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``deepnvme`` command line with ``argv`` (default: ``sys.argv[1:]``); returns
    the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad argument (already printed)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    if args.command is None:  # a usage error, as argparse treats a missing argument
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        with _sigterm_unwinds():
            return int(args.func(args))
    except (DeepNVMeError, OSError) as exc:  # UsageError, ConfigError, I/O errors: one line
        message = " ".join(str(exc).split())
        print(f"deepnvme {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C (SIGINT) or Terminated (SIGTERM)
        term = isinstance(exc, Terminated)
        print(f"deepnvme {args.command}: {'terminated' if term else 'interrupted'}; "
              "temporary files removed", file=sys.stderr)
        return 143 if term else 130


if __name__ == "__main__":
    sys.exit(main())
