"""``deepnvme verify DIR``: check one checkpoint, or every checkpoint of a CheckpointManager directory.

Each checkpoint is read whole and compared with its manifest: file size, tensor names and
sizes, and the per-tensor checksums when it has them (without them: structure and sizes only,
and the output says so). A ``step-N`` directory without its manifest (which the manager never
lists) is reported as incomplete. Exit status: 0 all intact, 1 any corrupt or incomplete
(named), 2 no checkpoint at DIR (or a usage error).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from ..checkpoint.manager._steps import find_leftovers
from ..checkpoint.manager._verify import CheckResult, check_one, find_targets
from ..errors import UsageError
from ._render import print_json, progress_bar

__all__ = ["run_verify", "add_verify_parser"]


def run_verify(path: str, *, progress: bool = False) -> list[CheckResult]:
    """Check every checkpoint at ``path`` (see the module docstring); empty list: none there."""
    if not os.path.isdir(path):
        raise UsageError(f"{path!r} is not a directory: pass a CheckpointManager directory or one of its "
                         "step directories")
    targets = find_targets(path)
    results = []
    with progress_bar("verifying", len(targets), enabled=progress) as bar:
        for target, step in targets:
            results.append(check_one(target, step))
            if bar is not None:
                bar.advance(bar.task_ids[0])
    return results


def _line(result: CheckResult) -> str:
    name = f"step {result.step}" if result.step is not None else result.path
    if result.problem is not None:
        return f"CORRUPT  {name}: {result.problem}"
    sums = (f"{result.checksum} checksums match" if result.checksum
            else "structure and sizes only: checksums were absent")
    what = f"{result.files} files of several ranks" if result.files is not None else f"{result.tensors} tensors"
    return f"ok       {name}: {what}, {sums}"


def _verify(args: argparse.Namespace) -> int:
    results = run_verify(args.directory, progress=not args.json)
    bad = [r for r in results if r.problem is not None]
    status = 2 if not results else 1 if bad else 0
    leftovers = find_leftovers(args.directory) if os.path.isdir(args.directory) else []
    if args.json:
        print_json({"path": os.path.abspath(args.directory), "status": status,
                    "checkpoints": [dataclasses.asdict(r) for r in results],
                    "leftovers": leftovers})
        return status
    for result in results:
        print(_line(result))
    for leftover in leftovers:
        print(f"note     {leftover}: left by an interrupted save or removal, not a checkpoint "
              "(the next CheckpointManager that writes here removes it)")
    if not results:
        print(f"no checkpoint in {os.path.abspath(args.directory)}")
    else:
        print(f"{len(results) - len(bad)} of {len(results)} checkpoints intact")
    return status


def add_verify_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``deepnvme verify``."""
    v: argparse.ArgumentParser = subparsers.add_parser(
        "verify", help="check CheckpointManager checkpoints (sizes, tensors, checksums)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("directory", metavar="DIR", help="a CheckpointManager directory or one step-N directory in it")
    v.add_argument("--json", action="store_true", help="print the results as JSON")
    v.set_defaults(func=_verify)
    return v
