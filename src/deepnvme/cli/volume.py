"""``deepnvme volume join|split|gather``: between volumes and plain files and folders.

``join`` copies a striped file into one plain file (which ``torch.load``, ``safetensors`` or any
tool reads); ``split`` stripes a plain file over the drives; ``gather`` copies a folder whose
files were placed on the drives (sharded safetensors, DCP) into one plain folder. All write
under temporary names and replace a target only once its bytes are on disk.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from ..checkpoint._placed import gather_folder
from ..checkpoint._striped import join_file, split_file
from ..config import checkpoint_config
from ..io.volume import Volume, env_stripe

__all__ = ["add_volume_parser"]


def _volume(args: argparse.Namespace) -> Volume:
    """The volume of ``--drives`` (else ``DEEPNVME_VOLUME``) and ``--stripe`` (else
    ``DEEPNVME_VOLUME_STRIPE``, else 1M); args.drives and args.stripe are filled in for the messages."""
    if not args.drives:
        named = Volume.from_env()
        if named is None:
            raise SystemExit("deepnvme volume: give the drives with --drives DIR [DIR ...] or set "
                             "DEEPNVME_VOLUME (directories joined by ':')")
        args.drives = list(named.paths)
    args.stripe = args.stripe or env_stripe()
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


def _gather(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    vol = _volume(args)
    names = gather_folder(vol if args.name == "." else vol / args.name, os.path.abspath(args.output))
    print(f"gathered {len(names)} files of {args.name} from {len(args.drives)} drives into "
          f"{args.output} in {time.perf_counter() - start:.2f} s")
    return 0


_DESCRIPTION = """\
Convert between a file striped over a volume (one directory per drive, as deepnvme.Volume)
and a plain file, or gather a folder whose files lie whole on different drives into one. The
drives must be given in the order the file was striped with, and the same stripe unit; a
mismatch is an error naming the drive, never wrong bytes."""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drives", nargs="+", metavar="DIR",
                   help="the volume's directories, one per drive, in order (default: DEEPNVME_VOLUME)")
    p.add_argument("--stripe", default=None,
                   help="stripe unit (default: DEEPNVME_VOLUME_STRIPE, else 1M)")


def add_volume_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``deepnvme volume`` with its ``join``, ``split`` and ``gather`` commands."""
    v: argparse.ArgumentParser = subparsers.add_parser(
        "volume", help="convert between volumes and plain files or folders",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = v.add_subparsers(dest="volume_command", metavar="{join,split,gather}", required=True)
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
    g = sub.add_parser("gather", help="copy a folder placed on the drives into one folder",
                       description="Copy the folder NAME ('.' for the drive directories "
                       "themselves), saved to the volume by save_safetensors_sharded or "
                       "NVMeStorageWriter, into the plain folder OUTPUT, which stock readers "
                       "(dcp.load, from_pretrained) take.")
    g.add_argument("name", metavar="NAME", help="the folder's name on the volume, or '.'")
    g.add_argument("output", metavar="OUTPUT", help="the plain folder to write into")
    _common(g)
    g.set_defaults(func=_gather)
    return v
