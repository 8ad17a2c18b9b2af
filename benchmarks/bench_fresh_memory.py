"""What a fresh load pays before any byte is read: first-touch page faults of new memory.

Usage: python benchmarks/bench_fresh_memory.py [--size 1G] [--reps 5] [--idle 0,3]

A fresh load must return new memory; a reader that maps the page cache (``torch.load(mmap=True)``,
``safetensors.load_file``) does not: its pages are filled by the device and mapped, never
zeroed. This times, in one process with interleaved repetitions: ``torch.empty`` + touching one
byte per 4 KiB page (what filling fresh tensors costs), ``mmap(MAP_POPULATE)`` (the kernel
faults the whole range in one call) and ``madvise(MADV_HUGEPAGE)`` + touch (transparent huge
pages, where the kernel gives them), and ``MADV_HUGEPAGE`` + ``MADV_POPULATE_WRITE``. Each
measurement runs after the previous one's memory was freed and ``--idle`` seconds passed: on a VM
whose balloon reports free pages to the host (virtio-balloon free page reporting; the kernel
reports free blocks of ``page_reporting_order`` after about 2 s), memory freed longer ago is
no longer backed by the host and costs a host fault on first touch. GB = 1e9 bytes; medians.
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
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # MAP_SHARED would be shmem: no THP
    m.madvise(mmap.MADV_HUGEPAGE)
    b = torch.frombuffer(m, dtype=torch.uint8)
    b[::4096] = 1
    dt = time.perf_counter() - t0
    with open("/proc/meminfo") as f:
        huge = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))
    del b
    m.close()
    return dt, huge


def _huge_populate(n: int) -> float:
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # MAP_SHARED would be shmem: no THP
    m.madvise(mmap.MADV_HUGEPAGE)
    t0 = time.perf_counter()
    m.madvise(23)  # MADV_POPULATE_WRITE (Linux 5.14+)
    dt = time.perf_counter() - t0
    m.close()
    return dt


def _reporting() -> str:
    """What this machine says about free page reporting (the order of the blocks it reports)."""
    try:
        with open("/sys/module/page_reporting/parameters/page_reporting_order") as f:
            return f"page_reporting_order {f.read().strip()}"
    except OSError:
        return "no page_reporting module parameter"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=1 << 30)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--idle", default="0,3",
                    help="seconds to wait after freeing before each measurement, comma-separated")
    args = ap.parse_args()
    n = args.size
    idles = [float(x) for x in args.idle.split(",")]
    methods = {"torch.empty + touch every 4 KiB page": _touch_new,
               "mmap(MAP_POPULATE)": _populate,
               "mmap + MADV_HUGEPAGE + touch": lambda k: _huge(k)[0],
               "mmap + MADV_HUGEPAGE + MADV_POPULATE_WRITE": _huge_populate}
    times: dict[tuple[str, float], list[float]] = {(m, i): [] for m in methods for i in idles}
    for _ in range(args.reps):
        for idle in idles:
            for name, fn in methods.items():
                time.sleep(idle)
                times[name, idle].append(fn(n))
    _, kb = _huge(n)
    print(f"{n / 1e9:.2f} GB per measurement, {args.reps} repetitions; {_reporting()}; "
          f"AnonHugePages seen under MADV_HUGEPAGE: {kb} kB")
    print("| fresh memory, first touch | " + " | ".join(f"GB/s, freed {i:g} s before" for i in idles)
          + " |\n|---|" + "---|" * len(idles))
    for name in methods:
        print(f"| {name} | " + " | ".join(f"{n / statistics.median(times[name, i]) / 1e9:.2f}"
                                         for i in idles) + " |")


if __name__ == "__main__":
    main()
