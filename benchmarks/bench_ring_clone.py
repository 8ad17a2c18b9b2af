"""io_uring CPU per GB at intra_op_parallelism 1, 2, 4: one registration of a locked buffer
cloned across the worker rings vs registered by every ring, side by side with fio.

Usage: python benchmarks/bench_ring_clone.py --dir DIR [--size 1G] [--reps 3] [--json out.json]

Each sample is a fresh process (as bench_engines.py): a new locked buffer of --size bytes, one
timed transfer, 1 MiB blocks, queue depth 32: a write over the existing file (fsync included)
or a cold O_DIRECT read (page cache dropped first). "per-ring" turns the clone off in that
process only (every ring pins the whole buffer, as before). CPU = getrusage(RUSAGE_SELF)
user+sys of the process around the transfer; fio: usr+sys of its job. Rounds interleave every
variant; medians [min-max].
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def worker(spec: dict) -> dict:
    import torch

    import deepnvme
    from deepnvme.io import uring

    if spec["variant"] == "per-ring":
        uring.UringQueue._clone_slot = lambda self, region, slot: False  # type: ignore[method-assign]
    h = deepnvme.AioHandle(block_size=1 << 20, queue_depth=32,
                           intra_op_parallelism=spec["p"], engine="io_uring")
    buf = deepnvme.new_cpu_locked_tensor(spec["size"], torch.uint8)
    buf.fill_(3)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if spec["op"] == "write":
        h.submit_write(buf, spec["path"], fsync=True).result()
    else:
        h.submit_read(buf, spec["path"]).result()
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    h.close()
    return {"seconds": t1 - t0, "cpu": r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime}


def run_fio(path: str, op: str, size: int) -> dict:
    cmd = ["fio", "--name=b", f"--filename={path}", f"--size={size}", "--ioengine=libaio",
           "--direct=1", "--bs=1M", "--iodepth=32", f"--rw={op}", "--output-format=json"]
    cmd += ["--end_fsync=1"] if op == "write" else []
    job = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)["jobs"][0]
    return {"seconds": job[op]["runtime"] / 1e3,
            "cpu": (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1e3}


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", type=lambda s: int(s[:-1]) << {"M": 20, "G": 30}[s[-1]], default=1 << 30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    path = os.path.join(args.dir, ".bench-ring-clone.bin")
    with open(path, "wb") as f:
        block = os.urandom(8 << 20)
        for _ in range(args.size // len(block)):
            f.write(block)
    labels = [(v, p) for p in (1, 2, 4) for v in ("clone", "per-ring")] + [("fio", 1)]
    samples: dict[str, list[dict]] = {}
    for rnd in range(args.reps):
        order = labels[rnd % len(labels):] + labels[:rnd % len(labels)]
        for variant, p in order:
            for op in ("write", "read"):
                if op == "read":
                    evict(path)
                if variant == "fio":
                    s = run_fio(path, op, args.size)
                else:
                    spec = {"variant": variant, "p": p, "op": op, "path": path, "size": args.size}
                    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                         capture_output=True, text=True, check=True).stdout
                    s = json.loads(out.strip().splitlines()[-1])
                samples.setdefault(f"{variant} p{p} {op}" if variant != "fio" else f"fio {op}", []).append(s)
        print(f"round {rnd + 1}/{args.reps}", file=sys.stderr, flush=True)
    os.unlink(path)
    gb = args.size / 1e9
    med = {}
    print("| variant | GB/s median [min-max] | CPU s/GB median [min-max] |\n|---|---|---|")
    for label, ss in samples.items():
        rates = [gb / s["seconds"] for s in ss]
        cpus = [s["cpu"] / gb for s in ss]
        med[label] = {"gbps": statistics.median(rates), "cpu_per_gb": statistics.median(cpus)}
        print(f"| {label} | {statistics.median(rates):.2f} [{min(rates):.2f}-{max(rates):.2f}] "
              f"| {statistics.median(cpus):.3f} [{min(cpus):.3f}-{max(cpus):.3f}] |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "medians": med, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
    else:
        main()
