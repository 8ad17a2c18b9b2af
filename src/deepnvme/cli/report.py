"""``deepnvme report``: is this environment usable for fast tensor I/O? (DeepSpeed's ds_report).

Runs :func:`~deepnvme.bench.run_report` and prints one line per check (OK, WARN or FAIL, with
a hint for anything not OK), or JSON. Exit status 1 when a check FAILed.

``--storage PATH`` (repeatable: the directories of a volume, also checked for sharing a
drive) checks the storage under PATH instead (:func:`~deepnvme.bench.run_storage_report`):
filesystem, O_DIRECT, mount and journal options, drives, RAID stripe against ``block_size``,
queue depth, scheduler, ``max_sectors_kb``, alignment and free space against ``--need``, as a
table with what to change and the command that changes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..bench import Report, run_report
from ..bench.report import FAIL, OK, UNKNOWN, WARN
from ..bench.storage_report import StorageReport, run_storage_report, volume_check
from ..errors import UsageError
from ._args import positive_size
from ._render import print_json, stdout_console

__all__ = ["add_report_parser", "render_report", "render_storage_report", "run_report"]

_COLOUR = {OK: "green", WARN: "yellow", FAIL: "bold red", UNKNOWN: "dim"}


def add_report_parser(subparsers: Any) -> None:
    """Register ``deepnvme report``."""
    r = subparsers.add_parser("report", help="check the environment (like ds_report) or the "
                              "storage under a path (--storage)", description=__doc__.split("\n\n")[0])
    r.add_argument("--dir", default=".", help="directory to check (default: .)")
    r.add_argument("--storage", metavar="PATH", action="append",
                   help="check the storage under PATH and say what to change, with commands; "
                        "repeat it for the directories of a volume (one per drive)")
    r.add_argument("--need", type=positive_size, metavar="SIZE",
                   help="with --storage: bytes a job will write under each PATH (K/M/G/T, binary)")
    r.add_argument("--json", action="store_true", help="print JSON instead of a table")
    r.set_defaults(func=_cmd_report)


def _cmd_report(args: Any) -> int:
    if args.storage is None:
        if args.need is not None:
            raise UsageError("--need goes with --storage PATH")
        report = run_report(args.dir)
        if args.json:
            print_json(report.to_dict())
        else:
            render_report(report, Console(highlight=False, soft_wrap=True))
        return 0 if report.ok else 1
    reports = [run_storage_report(path, need=args.need) for path in args.storage]
    volume = volume_check([r.facts for r in reports]) if len(reports) > 1 else None
    ok = all(r.ok for r in reports) and (volume is None or volume.status != FAIL)
    if args.json:
        print_json({"ok": ok, "reports": [r.to_dict() for r in reports],
                    "volume": None if volume is None else dataclasses.asdict(volume)})
        return 0 if ok else 1
    console = stdout_console()
    for storage in reports:
        render_storage_report(storage, console)
    if volume is not None:
        console.print(f"[{_COLOUR[volume.status]}]{volume.status}[/] volume: {escape(volume.value)}"
                      + (f"\n  {escape(volume.hint)}" if volume.status != OK else ""))
    return 0 if ok else 1


def render_report(report: Report, console: Console) -> None:
    """One coloured line per check, its hint below, and the counts last."""
    console.print(f"deepnvme report for {escape(report.directory)}")
    width = max(len(c.name) for c in report.checks)
    for c in report.checks:
        console.print(f"  [{_COLOUR[c.status]}]{c.status:<4}[/]  {c.name:<{width}}  {escape(c.value)}")
        if c.hint:
            console.print(f"  {'':4}  {'':<{width}}  hint: {escape(c.hint)}")
    counts = {s: sum(c.status == s for c in report.checks) for s in (OK, WARN, FAIL)}
    console.print(f"{counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL")


def render_storage_report(report: StorageReport, console: Console) -> None:
    """A table of the storage checks (status, check, observed value, what to change), then the
    commands unwrapped so they can be copied, and the counts last."""
    table = Table(title=f"storage under {escape(report.path)}", title_justify="left")
    for column in ("status", "check", "observed", "change"):
        table.add_column(column, overflow="fold")
    for c in report.checks:
        table.add_row(f"[{_COLOUR[c.status]}]{c.status}[/]", c.name, escape(c.value),
                      escape(c.hint) if c.status != OK else "")
    console.print(table)
    commands: dict[str, list[str]] = {}
    for c in report.checks:
        if c.command and c.status != OK:
            commands.setdefault(c.command, []).append(c.name)
    if commands:
        console.print("commands that make the changes (as root; fill in <placeholders> first):")
    for command, names in commands.items():
        console.print(f"  [bold]{escape(command)}[/]  # {', '.join(names)}", soft_wrap=True)
    counts = {s: sum(c.status == s for c in report.checks) for s in (OK, WARN, FAIL, UNKNOWN)}
    console.print(", ".join(f"{n} {s}" for s, n in counts.items()))
