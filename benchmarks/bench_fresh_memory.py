"""What a fresh load pays before any byte is read: first-touch page faults of new memory.

Usage: python benchmarks/bench_fresh_memory.py [--size 1G] [--reps 5]

A fresh load must return new memory; a reader that maps the page cache (``torch.load(mmap=True)``,
``safetensors.load_file``) does not: its pages are filled by the device and mapped, never
zeroed. This times, in one process with interleaved repetitions: ``torch.empty`` + touching one
byte per 4 KiB page (what filling fresh tensors costs), ``mmap(MAP_POPULATE)`` (the kernel
faults the whole range in one call) and ``madvise(MADV_HUGEPAGE)`` + touch (transparent huge
pages, where the kernel gives them). GB = 1e9 bytes; medians.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time

import torch

from deepnvme.config import parse_size


def _touch_new(n: int) -> float:
    t0 = time.perf_counter()
    a = torch.empty(n, dtype=torch.uint8)
    a[::4096] = 1
    return time.perf_counter() - t0


def _populate(n: int) -> float:
    t0 = time.perf_counter()
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    dt = time.perf_counter() - t0
    m.close()
    return dt


def _huge(n: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    m = mmap.mmap(-1, n)
    m.madvise(mmap.MADV_HUGEPAGE)
    b = torch.frombuffer(m, dtype=torch.uint8)
    b[::4096] = 1
    dt = time.perf_counter() - t0
    with open("/proc/meminfo") as f:
        huge = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))
    del b
    m.close()
    return dt, huge


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=1 << 30)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    n = args.size
    touch, populate, huge, huge_kb = [], [], [], []
    for _ in range(args.reps):
        touch.append(_touch_new(n))
        populate.append(_populate(n))
        dt, kb = _huge(n)
        huge.append(dt)
        huge_kb.append(kb)
    print("| fresh memory, first touch | GB/s (median) |\n|---|---|")
    print(f"| torch.empty + touch every 4 KiB page | {n / statistics.median(touch) / 1e9:.2f} |")
    print(f"| mmap(MAP_POPULATE) | {n / statistics.median(populate) / 1e9:.2f} |")
    print(f"| mmap + MADV_HUGEPAGE + touch (AnonHugePages seen: {max(huge_kb)} kB) | "
          f"{n / statistics.median(huge) / 1e9:.2f} |")


if __name__ == "__main__":
    main()
