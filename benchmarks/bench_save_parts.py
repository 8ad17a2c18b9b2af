"""The costs around a checkpoint save that are not disk bandwidth, measured one by one.

Usage: python benchmarks/bench_save_parts.py [--dir DIR] [--size 1G] [--reps 5]

1. Host copies (an async save's snapshot): ``Tensor.copy_`` against deepnvme's
   ``copy_bytes`` (ctypes ``memmove``, GIL released) on one thread and on every CPU, into a
   reused page-locked buffer, for one ``--size`` tensor and for the same bytes as 8 MiB tensors
   (below glibc's non-temporal threshold, so copied with ordinary stores).
2. Replacing a file of ``--size`` bytes (as every atomic save does): ``os.replace`` over it,
   which frees the old blocks inline, against deepnvme's commit, which frees them on a
   background thread (timed until return, and until the background close finished).
3. Fresh memory: touching every page of a new ``torch.empty`` of ``--size`` bytes (what any
   loader returning new tensors pays) against a reused buffer.

Medians over ``--reps``; GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

import deepnvme
from deepnvme.config import parse_size
from deepnvme.io import durable as atomic
from deepnvme.memory import copy as copy_mod

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import describe_machine, median_s  # noqa: E402


def make_file(path: str, size: int) -> None:
    """A file of ``size`` written bytes, on stable storage."""
    block = b"\x5a" * (8 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, size, len(block)):
            os.pwrite(fd, block[:min(len(block), size - off)], off)
        os.fsync(fd)
    finally:
        os.close(fd)


def copies(size: int, reps: int) -> list[tuple[str, float]]:
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    dst = deepnvme.new_cpu_locked_tensor(size, torch.uint8)
    piece = min(8 << 20, size)
    small = [(dst[o:o + piece], src[o:o + piece]) for o in range(0, size - piece + 1, piece)]
    moved = sum(d.numel() for d, _ in small)
    all_threads = copy_mod.copy_threads
    rows = []
    try:
        threads = torch.get_num_threads()
        rows.append((f"Tensor.copy_ ({threads} torch threads), one tensor",
                     size / median_s(lambda: dst.copy_(src), reps)))

        def torch_small() -> None:
            for d, s in small:
                d.copy_(s)

        rows.append((f"Tensor.copy_ ({threads} torch threads), 8 MiB tensors",
                     moved / median_s(torch_small, reps)))
        for threads in sorted({1, all_threads()}):
            copy_mod.copy_threads = lambda t=threads: t  # type: ignore[assignment]
            label = f"copy_bytes, {threads} thread{'s' if threads > 1 else ''}"
            rows.append((f"{label}, one tensor",
                         size / median_s(lambda: copy_mod.copy_bytes([(dst, src)]), reps)))
            rows.append((f"{label}, 8 MiB tensors",
                         moved / median_s(lambda: copy_mod.copy_bytes(small), reps)))
    finally:
        copy_mod.copy_threads = all_threads  # type: ignore[assignment]
        deepnvme.free_cpu_locked_tensor(dst)
    return [(name, gbs / 1e9) for name, gbs in rows]


def replaces(directory: str, size: int, reps: int) -> list[tuple[str, float]]:
    final, new = os.path.join(directory, "final.bin"), os.path.join(directory, "new.bin")
    inline, returned, freed = [], [], []
    try:
        for _ in range(reps):
            make_file(final, size)
            make_file(new, size)
            t0 = time.perf_counter()
            os.replace(new, final)
            atomic.fsync_dir(directory)
            inline.append(time.perf_counter() - t0)
            make_file(new, size)
            t0 = time.perf_counter()
            atomic.commit(new, final, fsync_file=False)
            returned.append(time.perf_counter() - t0)
            atomic.wait_for_releases()
            freed.append(time.perf_counter() - t0)
    finally:
        for p in (final, new):
            if os.path.exists(p):
                os.unlink(p)
    med = statistics.median
    return [("os.replace over the old file + fsync dir", med(inline) * 1e3),
            ("deepnvme commit, until it returns", med(returned) * 1e3),
            ("deepnvme commit, until the old file is freed", med(freed) * 1e3)]


def fresh_memory(size: int, reps: int) -> list[tuple[str, float]]:
    reused = torch.empty(size, dtype=torch.uint8)
    ctypes.memset(reused.data_ptr(), 0, size)

    def fresh() -> None:
        t = torch.empty(size, dtype=torch.uint8)
        ctypes.memset(t.data_ptr(), 0, size)

    return [("memset of a new torch.empty (page faults)", size / median_s(fresh, reps) / 1e9),
            ("memset of a reused buffer", size / median_s(
                lambda: ctypes.memset(reused.data_ptr(), 1, size), reps) / 1e9)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    work = os.path.join(os.path.abspath(args.dir), f".deepnvme-bench-parts-{os.getpid()}")
    os.makedirs(work)
    try:
        print(describe_machine(args.dir))
        print(f"size {args.size} bytes, {args.reps} reps, medians\n")
        print("| host copy | GB/s |\n|---|---|")
        for name, v in copies(args.size, args.reps):
            print(f"| {name} | {v:.1f} |")
        print("\n| replacing a file | ms |\n|---|---|")
        for name, v in replaces(work, args.size, args.reps):
            print(f"| {name} | {v:.0f} |")
        print("\n| touching memory | GB/s |\n|---|---|")
        for name, v in fresh_memory(args.size, args.reps):
            print(f"| {name} | {v:.1f} |")
    finally:
        os.rmdir(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
