"""GPU paths: device <-> file GB/s via AioHandle staging and GdsHandle, next to CPU-pinned and KvikIO.

Usage (on a CUDA machine; exits with a message elsewhere):
    flock /tmp/deepnvme-bench.lock python benchmarks/bench_gpu.py [--dir DIR] [--size 1G] [--reps 5]

Every peer moves the same ``--size`` bytes to/from one preallocated file in ``--dir``, rounds
interleaved so disk drift hits all alike. Writes are timed until fsync returns; reads are cold
(O_DIRECT for deepnvme; page cache dropped with posix_fadvise(DONTNEED) before every read, for
every peer). The CPU-pinned row is the reference: the staged rows should reach >= 0.9x of it.
GB = 1e9 bytes; medians over ``--reps``.

``--cpu-proxy`` (runs anywhere) measures only the pipeline's overhead: a plain CPU tensor goes
through the same staging pipeline with a CPU "copier" (memcpy on one thread, standing in for
the copy engine) next to the direct CPU-pinned transfer. It says nothing about PCIe or GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import deepnvme
from deepnvme.config import IOConfig, parse_size
from deepnvme.io.posix import evict_page_cache as evict


def timed(fn: Callable[[], Any], *, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def handle_peer(handle: deepnvme.AioHandle, buf: torch.Tensor) -> dict[str, Callable[[str], float]]:
    cuda = buf.is_cuda
    return {"write": lambda p: timed(lambda: handle.submit_write(buf, p, fsync=True).result(), cuda=cuda),
            "read": lambda p: timed(lambda: handle.submit_read(buf, p).result(), cuda=cuda)}


def kvikio_peer(buf: torch.Tensor) -> tuple[dict[str, Callable[[str], float]], str] | None:
    try:
        import kvikio  # type: ignore[import-not-found]
    except ImportError:
        return None

    def write(p: str) -> float:
        def go() -> None:
            with kvikio.CuFile(p, "r+") as f:
                f.pwrite(buf).get()
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return timed(go, cuda=True)

    def read(p: str) -> float:
        def go() -> None:
            with kvikio.CuFile(p, "r") as f:
                f.pread(buf).get()
        return timed(go, cuda=True)

    return {"write": write, "read": read}, f"kvikio {kvikio.__version__} ({kvikio_mode()})"


def kvikio_mode() -> str:
    """KvikIO's compatibility mode setting, across its API versions (``defaults.compat_mode()``
    until 24.x, ``defaults.get("compat_mode")`` after)."""
    try:
        import kvikio.defaults as defaults  # type: ignore[import-not-found]
    except ImportError as exc:
        return f"mode unknown: {exc}"
    for probe in ("compat_mode", "get"):
        fn = getattr(defaults, probe, None)
        if fn is None:
            continue
        try:
            value = fn() if probe == "compat_mode" else fn("compat_mode")
        except Exception:  # noqa: BLE001 - the label only
            continue
        return f"compat_mode={value}"
    return "mode unknown"


class ThreadCopier:
    """CPU stand-in for a CUDA copy engine: copies run in order on one thread."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor
        self.pool = ThreadPoolExecutor(1)

    def begin(self, tensor: torch.Tensor) -> None:
        return None

    def to_host(self, ticket: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        return self.pool.submit(dst.copy_, src)

    to_device = to_host

    def synchronize(self, event: Any) -> None:
        event.result()


class CpuProxyHandle(deepnvme.AioHandle):
    """Sends CPU tensors through the staging pipeline with a :class:`ThreadCopier`."""

    _STAGED_DEVICE_TYPES = ("cpu",)

    def _new_copier(self) -> ThreadCopier:
        return ThreadCopier()


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    size = args.size
    path = os.path.join(args.dir, ".deepnvme-bench-gpu")
    cfg = IOConfig(block_size=args.block_size, queue_depth=32, intra_op_parallelism=args.parallelism)
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, size)
    pinned = deepnvme.new_cpu_locked_tensor(size, torch.uint8)
    pinned.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    handles: list[deepnvme.AioHandle] = []
    peers: dict[str, dict[str, Callable[[str], float]]] = {}
    aio = deepnvme.AioHandle(config=cfg)
    handles.append(aio)
    peers["CPU pinned (AioHandle)"] = handle_peer(aio, pinned)
    if args.cpu_proxy:
        proxy = CpuProxyHandle(config=cfg)
        handles.append(proxy)
        peers["CPU tensor via staging (CPU copier proxy)"] = handle_peer(proxy, pinned.clone())
        return _measure(args, path, peers, handles)
    dev = pinned.cuda()
    peers["CUDA via aio staging"] = handle_peer(aio, dev)
    status = deepnvme.gds_status()
    if status.available:
        gds = deepnvme.GdsHandle(config=cfg)
        handles.append(gds)
        peers[f"CUDA via GdsHandle ({status.mode})"] = handle_peer(gds, dev)
        reg = gds.new_pinned_device_tensor(size, dev)
        reg.copy_(dev)
        peers[f"CUDA registered, GdsHandle ({status.mode})"] = handle_peer(gds, reg)
    else:
        print(f"GdsHandle skipped: {status.detail}", file=sys.stderr)
    kv = kvikio_peer(dev)
    if kv is not None:
        peers[kv[1]] = kv[0]
    else:
        print("KvikIO not installed: pip install kvikio-cu12 (or -cu13) to compare", file=sys.stderr)
    return _measure(args, path, peers, handles)


def _measure(args: argparse.Namespace, path: str, peers: dict[str, dict[str, Callable[[str], float]]],
             handles: list[deepnvme.AioHandle]) -> list[dict[str, Any]]:
    size = args.size
    times: dict[str, dict[str, list[float]]] = {name: {"write": [], "read": []} for name in peers}
    try:
        for _ in range(args.reps):
            for name, ops in peers.items():
                times[name]["write"].append(ops["write"](path))
                evict(path)
                times[name]["read"].append(ops["read"](path))
    finally:
        for h in handles:
            h.close()
        os.unlink(path)
    rows = []
    for name, t in times.items():
        rows.append({"peer": name, **{k: size / statistics.median(v) / 1e9 for k, v in t.items()}})
    return rows


def describe() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return (f"{platform.node()}: {os.cpu_count()} CPUs, {gpu}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=".", help="directory for the test file (on the NVMe)")
    parser.add_argument("--size", type=parse_size, default=parse_size("1G"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--block-size", type=parse_size, default=parse_size("1M"))
    parser.add_argument("--parallelism", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cpu-proxy", action="store_true",
                        help="no GPU: measure the staging pipeline's overhead with a CPU copier")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_proxy:
        print(f"bench_gpu: needs a CUDA device; torch {torch.__version__} sees none. "
              "Run it on a GPU machine (or use --cpu-proxy to measure the pipeline alone).",
              file=sys.stderr)
        return 2
    rows = run(args)
    if args.json:
        print(json.dumps({"machine": describe(), "size": args.size, "rows": rows}, indent=2))
        return 0
    print(f"{describe()}\n{args.size / 2**30:.2f} GiB, {args.reps} reps (medians), dir {os.path.abspath(args.dir)}, "
          f"block {args.block_size}, parallelism {args.parallelism}; GB = 1e9 bytes\n")
    ref = rows[0]
    print(f"| {'peer':44s} | write GB/s | read GB/s | write vs pinned | read vs pinned |")
    print(f"|{'-' * 46}|-----------:|----------:|----------------:|---------------:|")
    for r in rows:
        print(f"| {r['peer']:44s} | {r['write']:10.2f} | {r['read']:9.2f} | "
              f"{r['write'] / ref['write']:14.2f}x | {r['read'] / ref['read']:13.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
