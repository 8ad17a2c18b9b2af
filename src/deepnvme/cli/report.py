"""``deepnvme report``: is this environment usable for fast tensor I/O? (DeepSpeed's ds_report).

Runs :func:`~deepnvme.bench.run_report` and prints one line per check (OK, WARN or FAIL, with
a hint for anything not OK), or JSON. Exit status 1 when a check FAILed.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape

from ..bench import Report, run_report
from ..bench.report import FAIL, OK, WARN
from ._render import print_json

__all__ = ["add_report_parser", "render_report", "run_report"]


def add_report_parser(subparsers: Any) -> None:
    """Register ``deepnvme report``."""
    r = subparsers.add_parser("report", help="check the environment (like ds_report)",
                              description=__doc__.split("\n\n")[0])
    r.add_argument("--dir", default=".", help="directory to check (default: .)")
    r.add_argument("--json", action="store_true", help="print JSON instead of a table")
    r.set_defaults(func=_cmd_report)


def _cmd_report(args: Any) -> int:
    report = run_report(args.dir)
    if args.json:
        print_json(report.to_dict())
    else:
        render_report(report, Console(highlight=False, soft_wrap=True))
    return 0 if report.ok else 1


def render_report(report: Report, console: Console) -> None:
    """One coloured line per check, its hint below, and the counts last."""
    console.print(f"deepnvme report for {escape(report.directory)}")
    colour = {OK: "green", WARN: "yellow", FAIL: "bold red"}
    width = max(len(c.name) for c in report.checks)
    for c in report.checks:
        console.print(f"  [{colour[c.status]}]{c.status:<4}[/]  {c.name:<{width}}  {escape(c.value)}")
        if c.hint:
            console.print(f"  {'':4}  {'':<{width}}  hint: {escape(c.hint)}")
    counts = {s: sum(c.status == s for c in report.checks) for s in (OK, WARN, FAIL)}
    console.print(f"{counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL")
