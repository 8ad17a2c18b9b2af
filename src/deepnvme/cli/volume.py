"""``deepnvme volume join|split``: convert between a file striped over a volume and a plain one.

``join`` copies a striped file into one plain file (which ``torch.load``, ``safetensors`` or any
tool reads); ``split`` stripes a plain file over the drives. Both write under a temporary name
and replace the target only once every byte is on disk.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from ..checkpoint._striped import join_file, split_file
from ..config import checkpoint_config
from ..io.volume import Volume

__all__ = ["add_volume_parser"]


def _volume(args: argparse.Namespace) -> Volume:
    return Volume(args.drives, stripe=args.stripe)


def _join(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    n = join_file(_volume(args) / args.name, os.path.abspath(args.output), checkpoint_config(None))
    print(f"joined {args.name} ({n} bytes, {len(args.drives)} drives) into {args.output} "
          f"in {time.perf_counter() - start:.2f} s")
    return 0


def _split(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    n = split_file(os.path.abspath(args.input), _volume(args) / args.name, checkpoint_config(None))
    print(f"split {args.input} ({n} bytes) into {args.name} over {len(args.drives)} drives "
          f"(stripe {args.stripe}) in {time.perf_counter() - start:.2f} s")
    return 0


_DESCRIPTION = """\
Convert between a file striped over a volume (one directory per drive, as deepnvme.Volume)
and a plain file. The drives must be given in the order the file was striped with, and the
same stripe unit; a mismatch is an error naming the drive, never wrong bytes."""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drives", nargs="+", required=True, metavar="DIR",
                   help="the volume's directories, one per drive, in order")
    p.add_argument("--stripe", default="1M", help="stripe unit (default 1M)")


def add_volume_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``deepnvme volume`` with its ``join`` and ``split`` commands."""
    v: argparse.ArgumentParser = subparsers.add_parser(
        "volume", help="convert between striped and plain files",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = v.add_subparsers(dest="volume_command", metavar="{join,split}", required=True)
    j = sub.add_parser("join", help="copy a striped file into one plain file",
                       description="Copy the striped file NAME of the volume into OUTPUT.")
    j.add_argument("name", metavar="NAME", help="the file's name on the volume")
    j.add_argument("output", metavar="OUTPUT", help="the plain file to write (replaced)")
    _common(j)
    j.set_defaults(func=_join)
    s = sub.add_parser("split", help="stripe a plain file over the volume's drives",
                       description="Copy the plain file INPUT into the striped file NAME.")
    s.add_argument("input", metavar="INPUT", help="the plain file to read")
    s.add_argument("name", metavar="NAME", help="the file's name on the volume (replaced)")
    _common(s)
    s.set_defaults(func=_split)
    return v
