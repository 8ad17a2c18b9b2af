"""deepnvme vs fio vs plain Python: 1 GiB writes (fsync'd) and cold reads on one file, one run.

Usage: python benchmarks/bench_engine.py [--dir DIR] [--size 1G] [--reps 5]

Every tool writes the same preallocated file in the same directory; rounds interleave the tools
so drift in the (virtual) disk hits them alike. Writes are timed to stable storage (fsync, or
fio's end_fsync); reads are cold (O_DIRECT for deepnvme and fio, page cache dropped with
posix_fadvise(DONTNEED) for plain Python). GB = 1e9 bytes. Medians over repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

import deepnvme
from deepnvme.config import IOConfig, parse_size
from deepnvme.io.posix import evict_page_cache as evict

DEEPNVME_CONFIGS = {
    "deepnvme p1": IOConfig(block_size=1 << 20, queue_depth=32, intra_op_parallelism=1),
    "deepnvme p4": IOConfig(block_size=1 << 20, queue_depth=32, intra_op_parallelism=4),
    "deepnvme p8": IOConfig(block_size=1 << 20, queue_depth=32, intra_op_parallelism=8),
}




def median_s(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn``, in seconds."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def deepnvme_write(handle: deepnvme.AioHandle, buf: torch.Tensor, path: str) -> float:
    t0 = time.perf_counter()
    handle.submit_write(buf, path, fsync=True).result()
    return time.perf_counter() - t0


def deepnvme_read(handle: deepnvme.AioHandle, buf: torch.Tensor, path: str) -> float:
    t0 = time.perf_counter()
    handle.submit_read(buf, path).result()
    return time.perf_counter() - t0


def python_write(buf: torch.Tensor, path: str) -> float:
    view = deepnvme.memory.views.byte_view(buf)
    t0 = time.perf_counter()
    with open(path, "r+b", buffering=0) as f:
        f.write(view)
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def python_read(buf: torch.Tensor, path: str) -> float:
    view = deepnvme.memory.views.byte_view(buf)
    evict(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        n = f.readinto(view)
    elapsed = time.perf_counter() - t0
    if n != len(view):
        raise RuntimeError(f"short read: {n} of {len(view)}")
    return elapsed


def fio(path: str, size: int, rw: str) -> float:
    """Seconds for fio to move ``size`` bytes (size / fio's own reported bandwidth)."""
    cmd = ["fio", "--name=bench", f"--filename={path}", f"--size={size}", "--bs=1m", f"--rw={rw}",
           "--ioengine=libaio", "--direct=1", "--iodepth=32", "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    job = out["jobs"][0]["write" if rw == "write" else "read"]
    return size / job["bw_bytes"]


def ensure_fio() -> bool:
    """fio on PATH, installing Debian's package first when missing and we are root."""
    if shutil.which("fio"):
        return True
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("fio not found: installing Debian's fio package", file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "-q", "fio"], check=False,
                       stdout=subprocess.DEVNULL)
    if not shutil.which("fio"):
        print("fio unavailable (apt-get install fio): its rows are left out", file=sys.stderr)
    return shutil.which("fio") is not None


def describe_machine(directory: str) -> str:
    dev = subprocess.run(["df", "--output=source,fstype", directory], capture_output=True,
                         text=True).stdout.split("\n")[1].split()
    return (f"{platform.node()}: {os.cpu_count()} CPUs, Linux {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, {directory} on {dev[0]} ({dev[1]})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    have_fio = ensure_fio()
    path = os.path.join(args.dir, f".bench-engine-{os.getpid()}.bin")
    buf = deepnvme.new_cpu_locked_tensor(args.size, torch.uint8)
    buf.copy_(torch.randint(0, 256, (args.size,), dtype=torch.uint8))
    handles = {name: deepnvme.AioHandle(config=cfg) for name, cfg in DEEPNVME_CONFIGS.items()}
    results: dict[str, dict[str, list[float]]] = {}
    try:
        deepnvme_write(handles["deepnvme p1"], buf, path)  # lay the file out once
        for rep in range(args.reps):
            for name, h in handles.items():
                r = results.setdefault(name, {"write": [], "read": []})
                r["write"].append(deepnvme_write(h, buf, path))
                r["read"].append(deepnvme_read(h, buf, path))
            r = results.setdefault("plain Python", {"write": [], "read": []})
            r["write"].append(python_write(buf, path))
            r["read"].append(python_read(buf, path))
            if have_fio:
                r = results.setdefault("fio libaio qd32", {"write": [], "read": []})
                r["write"].append(fio(path, args.size, "write"))
                r["read"].append(fio(path, args.size, "read"))
            print(f"round {rep + 1}/{args.reps} done", file=sys.stderr)
    finally:
        for h in handles.values():
            h.close()
        os.unlink(path)
    print(describe_machine(os.path.abspath(args.dir)))
    print(f"{args.size / 2**30:.2f} GiB per op, {args.reps} reps, median GB/s (GB = 1e9 B); "
          "min-max in brackets")
    ref = results.get("fio libaio qd32")
    med = {n: {k: statistics.median(args.size / s / 1e9 for s in v) for k, v in r.items()}
           for n, r in results.items()}
    header = f"| {'tool':18s} | {'write GB/s':>18s} | {'read GB/s':>18s} |"
    if ref:
        header += " write / fio | read / fio |"
    print(header)
    print("|" + "---|" * (5 if ref else 3))
    for name, r in results.items():
        cells = []
        for kind in ("write", "read"):
            rates = [args.size / s / 1e9 for s in r[kind]]
            cells.append(f"{med[name][kind]:5.2f} [{min(rates):.2f}-{max(rates):.2f}]")
        line = f"| {name:18s} | {cells[0]:>18s} | {cells[1]:>18s} |"
        if ref:
            line += (f" {med[name]['write'] / med['fio libaio qd32']['write']:11.2f} |"
                     f" {med[name]['read'] / med['fio libaio qd32']['read']:10.2f} |")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
