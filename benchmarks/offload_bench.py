"""NVMe optimizer offload benchmark: AdamW step time and peak RSS, in memory vs NVMeOptimizer.

Each mode runs in its own subprocess so its peak RSS (VmHWM) is its own. The storage's
bandwidth is measured in the same run with the same handle settings (O_DIRECT, cold reads,
writes timed through fsync), and gives the I/O roofline of an offloaded step:
``(bytes_read + bytes_written) / GBps`` where GBps is measured reading one file while writing
another (as a step does); the read-then-write sum is printed too. GB = 1e9 bytes.

    flock /tmp/deepnvme-bench.lock python benchmarks/offload_bench.py --dir /path/on/nvme
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import deepnvme  # noqa: E402
from deepnvme.optim import NVMeOptimizer  # noqa: E402


def status(field: str) -> int:
    """A /proc/self/status memory field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def make_params(total: int, rows: int = 8192, cols: int = 1024) -> list[torch.nn.Parameter]:
    n = max(1, total // (rows * cols))
    g = torch.Generator().manual_seed(0)
    params = []
    for _ in range(n):
        p = torch.nn.Parameter(torch.randn(rows, cols, generator=g) * 0.02)
        p.grad = torch.randn(rows, cols, generator=g) * 1e-3
        params.append(p)
    return params


def run_mode(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    params = make_params(args.params)
    config = deepnvme.IOConfig(block_size=args.block_size, intra_op_parallelism=args.io_threads)
    baseline = status("VmRSS")
    if args.mode == "memory":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    else:
        opt = NVMeOptimizer(params, torch.optim.AdamW, swap_dir=args.dir, config=config,
                            sub_group_bytes=args.sub_group_bytes, buffer_count=args.buffers,
                            lr=1e-4, weight_decay=0.01)
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        opt.step()
        if step > 0:  # step 0 creates the state
            times.append(time.perf_counter() - t0)
    out = {"mode": args.mode, "step_s": times, "state_rss": status("VmHWM") - baseline,
           "n_params": sum(p.numel() for p in params)}
    if isinstance(opt, NVMeOptimizer):
        out["state_bytes"] = opt.swapped_bytes
        out["sub_groups"] = opt.num_sub_groups
        opt.close()
    else:
        out["state_bytes"] = sum(v.numel() * v.element_size() for st in opt.state.values()
                                 for v in st.values() if v.dim() > 0)
    return out


def measure_bandwidth(args: argparse.Namespace, nbytes: int) -> tuple[float, float, float]:
    """(write GB/s through fsync, cold read GB/s, mixed GB/s) of ``nbytes`` in 64 MiB requests.

    Mixed: ``nbytes`` read cold from one file while ``nbytes`` are written to another (the
    access pattern of an offloaded step), total bytes over the time until both are done."""
    cfg = deepnvme.IOConfig(block_size=args.block_size, intra_op_parallelism=args.io_threads)
    chunk = 64 << 20
    bufs = [deepnvme.new_cpu_locked_tensor(chunk, torch.uint8) for _ in range(2)]
    for b in bufs:
        b.random_(0, 256)
    os.makedirs(args.dir, exist_ok=True)   # the optimizers that made it removed it when empty
    path = os.path.join(args.dir, "bw.bin")
    other = os.path.join(args.dir, "bw2.bin")
    writes, reads, mixed = [], [], []
    with deepnvme.AioHandle(config=cfg) as h:
        for _ in range(args.reps):
            t0 = time.perf_counter()
            futs = [h.submit_write(bufs[i % 2], path, offset=off)
                    for i, off in enumerate(range(0, nbytes, chunk))]
            for f in futs:
                f.result()
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            writes.append(nbytes / (time.perf_counter() - t0) / 1e9)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            t0 = time.perf_counter()
            futs = [h.submit_read(bufs[i % 2], path, offset=off)
                    for i, off in enumerate(range(0, nbytes, chunk))]
            for f in futs:
                f.result()
            reads.append(nbytes / (time.perf_counter() - t0) / 1e9)
            rbufs = [deepnvme.new_cpu_locked_tensor(chunk, torch.uint8) for _ in range(2)]
            t0 = time.perf_counter()
            futs = []
            for i, off in enumerate(range(0, nbytes, chunk)):
                futs.append(h.submit_read(rbufs[i % 2], path, offset=off))
                futs.append(h.submit_write(bufs[i % 2], other, offset=off))
            for f in futs:
                f.result()
            fd = os.open(other, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            mixed.append(2 * nbytes / (time.perf_counter() - t0) / 1e9)
            os.unlink(other)
    os.unlink(path)
    return statistics.median(writes), statistics.median(reads), statistics.median(mixed)


def spawn(args: argparse.Namespace, mode: str, **extra: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--dir", args.dir]
    for k in ("params", "steps", "sub_group_bytes", "buffers", "block_size", "io_threads", "threads"):
        cmd += [f"--{k.replace('_', '-')}", str(extra.get(k, getattr(args, k)))]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the storage to test (default: a temp dir in cwd)")
    ap.add_argument("--params", type=int, default=200_000_000, help="fp32 parameters (AdamW state = 8 B each)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode (after one warm-up step)")
    ap.add_argument("--sub-group-bytes", type=int, default=32 << 20)
    ap.add_argument("--buffers", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=8 << 20)
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    ap.add_argument("--reps", type=int, default=3, help="bandwidth repetitions")
    ap.add_argument("--child", choices=["memory", "nvme"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.mode = args.child
        print(json.dumps(run_mode(args)))
        return
    tmp = None
    if args.dir is None:
        tmp = tempfile.TemporaryDirectory(dir=os.getcwd(), prefix="offload-bench-")
        args.dir = tmp.name

    mem = spawn(args, "memory")
    nvme = spawn(args, "nvme")
    nvme2 = spawn(args, "nvme", buffers=2)
    state = nvme["state_bytes"]
    w_bw, r_bw, m_bw = measure_bandwidth(args, min(state, 1 << 30))
    serial = state / (r_bw * 1e9) + state / (w_bw * 1e9)
    roofline = 2 * state / (m_bw * 1e9)

    print(f"AdamW, {mem['n_params'] / 1e6:.0f} M fp32 params, state {state / 1e9:.2f} GB "
          f"({state / 2**30:.2f} GiB), {nvme['sub_groups']} sub-groups of "
          f"{args.sub_group_bytes >> 20} MiB params; torch threads {args.threads}, I/O threads "
          f"{args.io_threads}, block {args.block_size >> 10} KiB; medians of {args.steps} steps")
    print(f"storage ({args.dir}): write {w_bw:.2f} GB/s (O_DIRECT, through fsync), cold read "
          f"{r_bw:.2f} GB/s, concurrent read+write {m_bw:.2f} GB/s (medians of {args.reps})")
    print(f"bytes per offloaded step: read {state / 1e9:.2f} GB + written {state / 1e9:.2f} GB; "
          f"roofline {roofline:.2f} s at the concurrent rate (read then write one after the "
          f"other: {serial:.2f} s)")
    print()
    print(f"{'mode':<28}{'step s':>9}{'/roofline':>11}{'state RSS GB':>14}{'% of memory':>13}")
    for name, r in (("in memory (torch AdamW)", mem), ("NVMeOptimizer, 3 buffers", nvme),
                    ("NVMeOptimizer, 2 buffers", nvme2)):
        t = statistics.median(r["step_s"])
        ratio = f"{t / roofline:.2f}" if r is not mem else "-"
        print(f"{name:<28}{t:>9.2f}{ratio:>11}{r['state_rss'] / 1e9:>14.2f}"
              f"{100 * r['state_rss'] / mem['state_rss']:>12.1f}%")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
