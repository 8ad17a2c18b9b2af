"""A two-drive deepnvme volume vs fio on both drives at once, deepnvme on one drive, and btrfs RAID-0.

Usage: python benchmarks/bench_volume.py --drives DIR0 DIR1 [--btrfs DIR] [--size 1G]
       [--reps 5] [--stripe 1M] [--label capped] [--json OUT]

Sequential writes of SIZE bytes to a new file, timed until fsync returns (fio: end_fsync=1),
and cold reads of it (O_DIRECT for deepnvme and fio), per tool, rounds interleaved:
- "deepnvme volume": one striped file over DIR0 and DIR1 (``deepnvme.Volume``), one handle;
- "fio 2 jobs (sum)": one fio run with one job per drive (SIZE/2 each, libaio, qd32, 1 MiB),
  the sum of the two jobs' bandwidths, the figure a perfect two-drive stripe would reach;
- "deepnvme 1 drive": the same handle on one plain file in DIR0;
- "deepnvme on btrfs raid0": the same handle on one plain file in DIR (when given), and
  "fio on btrfs raid0": one fio job there.
Each file is removed after its read (the drives need hold only one at a time). GB = 1e9
bytes; medians over repetitions; CPU seconds of this process (getrusage) for deepnvme rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time

import torch

import deepnvme
from deepnvme.config import parse_size
from deepnvme.io.volume_files import remove as remove_striped


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def timed(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    t0, c0 = time.perf_counter(), _cpu()
    fn()
    return time.perf_counter() - t0, _cpu() - c0


def deepnvme_pair(h: deepnvme.AioHandle, buf: torch.Tensor, target, remove) -> dict:  # type: ignore[no-untyped-def]
    """Write ``target`` new (fsynced), read it cold, remove it."""
    remove()
    w, wc = timed(lambda: h.submit_write(buf, target, fsync=True).result())
    r, rc = timed(lambda: h.submit_read(buf, target).result())
    remove()
    return {"write": w, "read": r, "write_cpu": wc, "read_cpu": rc}


def fio_pair(dirs: list[str], size: int) -> dict:
    """One fio run per direction, one job per directory, ``size / len(dirs)`` bytes each."""
    files = [os.path.join(d, f".bench-volume-fio-{os.getpid()}.bin") for d in dirs]
    out = {}
    for rw in ("write", "read"):
        if rw == "write":
            for f in files:
                if os.path.exists(f):
                    os.unlink(f)
        cmd = ["fio", "--output-format=json", "--ioengine=libaio", "--direct=1", "--bs=1m",
               "--iodepth=32", f"--rw={rw}", f"--size={size // len(dirs)}"]
        if rw == "write":
            cmd.append("--end_fsync=1")
        for i, f in enumerate(files):
            cmd += [f"--name=drive{i}", f"--filename={f}"]
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        bw = sum(job[rw]["bw_bytes"] for job in res["jobs"])
        out[rw] = size / bw
    for f in files:
        os.unlink(f)
    return out


def _unlink(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drives", nargs=2, required=True, metavar="DIR")
    ap.add_argument("--btrfs", default=None, metavar="DIR", help="a btrfs RAID-0 directory")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stripe", default="1M")
    ap.add_argument("--label", default="", help="what the run measured (e.g. capped 1G/s)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--no-fio", action="store_true")
    args = ap.parse_args()
    have_fio = not args.no_fio and shutil.which("fio") is not None
    vol = deepnvme.Volume([os.path.join(d, f".bench-volume-{os.getpid()}") for d in args.drives],
                          stripe=args.stripe)
    vpath = vol / "bench.bin"
    single = os.path.join(args.drives[0], f".bench-volume-single-{os.getpid()}.bin")
    on_btrfs = (os.path.join(args.btrfs, f".bench-volume-{os.getpid()}.bin")
                if args.btrfs else None)
    buf = deepnvme.new_cpu_locked_tensor(args.size, torch.uint8)
    buf.copy_(torch.randint(0, 256, (args.size,), dtype=torch.uint8))
    runs: dict[str, list[dict]] = {}
    try:
        with deepnvme.AioHandle() as h:
            for _ in range(args.reps):
                runs.setdefault("deepnvme volume", []).append(
                    deepnvme_pair(h, buf, vpath, lambda: remove_striped(vpath)))
                if have_fio:
                    runs.setdefault("fio 2 jobs (sum)", []).append(fio_pair(args.drives, args.size))
                runs.setdefault("deepnvme 1 drive", []).append(
                    deepnvme_pair(h, buf, single, lambda: _unlink(single)))
                if on_btrfs:
                    runs.setdefault("deepnvme on btrfs raid0", []).append(
                        deepnvme_pair(h, buf, on_btrfs, lambda: _unlink(on_btrfs)))  # type: ignore[arg-type]
                    if have_fio:
                        runs.setdefault("fio on btrfs raid0", []).append(
                            fio_pair([args.btrfs], args.size))
            engine = h.engine
    finally:
        remove_striped(vpath)
        for d in vol.paths:
            if os.path.isdir(d):
                os.rmdir(d)
        _unlink(single)
        if on_btrfs:
            _unlink(on_btrfs)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"{args.label}: {args.size / 1e9:.2f} GB, {args.reps} reps, stripe {args.stripe}, "
          f"engine {engine}, {platform.node()} ({os.cpu_count()} CPUs)")
    print(f"| {'tool':<26} | write GB/s | read GB/s | volume / it, write | volume / it, read |")
    print(f"|{'-' * 28}|-----------:|----------:|-------------------:|------------------:|")
    base = med["deepnvme volume"]
    for name, m in med.items():
        print(f"| {name:<26} | {args.size / m['write'] / 1e9:10.2f} | "
              f"{args.size / m['read'] / 1e9:9.2f} | {m['write'] / base['write']:18.2f} | "
              f"{m['read'] / base['read']:17.2f} |")
    for peer in [p for p in med if p != "deepnvme volume"]:
        print(f"volume / {peer}: write {med[peer]['write'] / base['write']:.2f}x, "
              f"read {med[peer]['read'] / base['read']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"label": args.label, "size": args.size, "reps": args.reps,
                       "stripe": args.stripe, "engine": engine, "node": platform.node(),
                       "cpus": os.cpu_count(), "torch": torch.__version__,
                       "drives": args.drives, "btrfs": args.btrfs, "runs": runs,
                       "median_s": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
