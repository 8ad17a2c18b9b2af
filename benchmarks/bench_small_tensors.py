"""What many tiny tensors cost on disk and in time: deepnvme.save/load against torch.save/load.

Usage: python benchmarks/bench_small_tensors.py [--dir DIR] [--count 10000] [--numel 16] [--reps 3]

``deepnvme.save`` aligns every storage record to 4 KiB (``STORAGE_ALIGNMENT``, for O_DIRECT),
``torch.save`` to 64 bytes, so a state dict of many tiny tensors is far larger on disk when
deepnvme writes it. Prints file sizes and median save/load times side by side. Saves are timed
until durable (torch.save's file is fsynced inside the timing, as deepnvme.save does itself);
loads read warm files (page cache), since tiny files are rarely read cold.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

import deepnvme

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import median_s  # noqa: E402


def torch_save_durable(obj: object, path: str) -> None:
    """torch.save, then fsync: the same durability deepnvme.save gives."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    """Parse the options, save and load the same state dict both ways, print one table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".", help="where the two files are written (default: .)")
    ap.add_argument("--count", type=int, default=10_000, help="tensors in the state dict")
    ap.add_argument("--numel", type=int, default=16, help="float32 elements per tensor")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (median printed)")
    args = ap.parse_args()

    state = {f"t{i}": torch.randn(args.numel) for i in range(args.count)}
    payload = args.count * args.numel * 4
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-small-") as tmp:
        t_path, d_path = os.path.join(tmp, "torch.pt"), os.path.join(tmp, "deepnvme.pt")
        rows = [
            ("torch.save / torch.load", t_path,
             median_s(lambda: torch_save_durable(state, t_path), args.reps),
             lambda: torch.load(t_path, weights_only=True)),
            ("deepnvme.save / deepnvme.load", d_path,
             median_s(lambda: deepnvme.save(state, d_path), args.reps),
             lambda: deepnvme.load(d_path)),
        ]
        deepnvme.checkpoint.wait_for_releases()
        for _, _, _, load in rows:
            back = load()
            assert all(torch.equal(back[k], v) for k, v in state.items())
        print(f"{args.count} tensors x {args.numel} float32 = {payload:,} bytes of tensor data, "
              f"median of {args.reps}")
        print(f"{'tool':32} {'file bytes':>12} {'x payload':>9} {'save s':>8} {'load s':>8}")
        for name, path, save_s, load in rows:
            size = os.path.getsize(path)
            load_s = median_s(load, args.reps)
            print(f"{name:32} {size:>12,} {size / payload:>9.1f} {save_s:>8.3f} {load_s:>8.3f}")


if __name__ == "__main__":
    main()
