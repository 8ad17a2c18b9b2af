"""DCP storage side by side: deepnvme's NVMeStorageWriter/Reader against stock FileSystemWriter/Reader.

Usage: flock /tmp/deepnvme-bench.lock python -W ignore benchmarks/bench_dcp.py [--dir DIR]
       [--size 1G] [--tensors 32] [--small-count 20000] [--reps 5] [--cases large,small,reshard]
       [--json out.json]

Cases, each saved and loaded by both storages in one process, repetitions interleaved (the
order alternates every repetition), medians printed with [min-max]:

* ``large``: ``--size`` bytes of float32 in ``--tensors`` equal 2-D tensors.
* ``small``: ``--small-count`` float32 tensors of 1-64 KiB (seeded random sizes).
* ``reshard``: the ``large`` checkpoint loaded by a planner that asks for rows ``[0, n/2)`` of
  every tensor into tensors of half the rows, as rank 0 of 2 does after resharding a 1-rank
  save along dim 0 (DCP's ``create_read_items_for_chunk_list``); GB/s counts the half loaded.

Saves are timed until durable: stock with ``sync_files=True`` (fsync of every data file), ours
always fsyncs; each save goes into a new empty directory. Loads are cold: before each load
every file of the checkpoint gets ``posix_fadvise(POSIX_FADV_DONTNEED)`` (after an fsync) so
its pages leave the page cache; the target state dict is allocated once, outside the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from deepnvme.dcp import NVMeStorageReader, NVMeStorageWriter


def parse_size(text: str) -> int:
    """``1G``, ``512M``, ``64K`` or a plain byte count, in bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


class RowHalfPlanner(DefaultLoadPlanner):
    """Loads rows ``[0, n/2)`` of each saved 2-D tensor into a state dict of half-row tensors."""

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise RuntimeError("set_up_planner was not called")
        items = []
        for fqn, target in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            if not isinstance(md, TensorStorageMetadata):
                raise TypeError(f"{fqn}: not a tensor in the checkpoint")
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * target.dim()), sizes=target.size())
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)


def drop_cache(directory: str) -> None:
    """Evict every file under ``directory`` from the page cache (fsync first so pages are clean)."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def large_state(size: int, tensors: int) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors of 1024 columns adding up to about ``size`` bytes."""
    rows = max(2, size // tensors // 4096)
    return {f"layer{i}.weight": torch.randn(rows, 1024) for i in range(tensors)}


def small_state(count: int) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of 1-64 KiB each (sizes from a fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(256, 16 * 1024 + 1, (count,), generator=gen).tolist()
    return {f"p{i}": torch.randn(n) for i, n in enumerate(sizes)}


Storage = tuple[str, Callable[[str], Any], Callable[[str], Any]]
STORAGES: list[Storage] = [
    ("stock", lambda p: FileSystemWriter(p, sync_files=True), FileSystemReader),
    ("deepnvme", NVMeStorageWriter, NVMeStorageReader),
]


def nbytes(state: dict[str, torch.Tensor]) -> int:
    """Tensor bytes in a state dict."""
    return sum(t.nbytes for t in state.values())


def run_case(name: str, state: dict[str, torch.Tensor], root: str, reps: int, *,
             reshard: bool) -> dict[str, dict[str, list[float]]]:
    """Save and load ``state`` with each storage ``reps`` times, alternating the order; GB/s lists."""
    out: dict[str, dict[str, list[float]]] = {s[0]: {"save": [], "load": []} for s in STORAGES}
    if reshard:
        target = {k: torch.empty(v.shape[0] // 2, *v.shape[1:]) for k, v in state.items()}
    else:
        target = {k: torch.empty_like(v) for k, v in state.items()}
    for rep in range(reps):
        order = STORAGES if rep % 2 == 0 else STORAGES[::-1]
        for label, writer, _reader in order:
            path = os.path.join(root, f"{name}-{label}-{rep}")
            os.makedirs(path)
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=writer(path), no_dist=True)
            out[label]["save"].append(nbytes(state) / (time.perf_counter() - t0) / 1e9)
        for label, _writer, reader in order:
            path = os.path.join(root, f"{name}-{label}-{rep}")
            drop_cache(path)
            for t in target.values():
                t.zero_()
            planner = RowHalfPlanner() if reshard else DefaultLoadPlanner()
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=reader(path), planner=planner, no_dist=True)
            out[label]["load"].append(nbytes(target) / (time.perf_counter() - t0) / 1e9)
            for k, v in target.items():
                if not torch.equal(v, state[k][:v.shape[0]]):
                    raise RuntimeError(f"{label} {name}: {k} loaded wrong bytes")
        for label, _w, _r in order:
            shutil.rmtree(os.path.join(root, f"{name}-{label}-{rep}"))
    return out


def fmt(values: list[float]) -> str:
    """Median [min-max]."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    """Parse options, run the cases, print one table (ratio ours/stock last), optionally JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".", help="where checkpoints are written (default: .)")
    ap.add_argument("--size", default="1G", help="bytes of the large state dict (default 1G)")
    ap.add_argument("--tensors", type=int, default=32, help="tensors in the large state dict")
    ap.add_argument("--small-count", type=int, default=20_000, help="tensors in the small case")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per case (median printed)")
    ap.add_argument("--cases", default="large,small,reshard", help="comma-separated cases")
    ap.add_argument("--json", help="also write the raw GB/s lists here")
    args = ap.parse_args()

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    results: dict[str, Any] = {}
    large = large_state(parse_size(args.size), args.tensors)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-dcp-") as root:
        for case in cases:
            if case == "small":
                state, reshard = small_state(args.small_count), False
            elif case in ("large", "reshard"):
                state, reshard = large, case == "reshard"
            else:
                raise SystemExit(f"unknown case {case!r}")
            results[case] = {"bytes": nbytes(state),
                             **run_case(case, state, root, args.reps, reshard=reshard)}

    print(f"median GB/s [min-max] of {args.reps}; saves durable, loads cold (fadvise DONTNEED)")
    print(f"{'case':10} {'stock save':>20} {'deepnvme save':>20} {'x':>5} "
          f"{'stock load':>20} {'deepnvme load':>20} {'x':>5}")
    for case, r in results.items():
        ratio = {op: statistics.median(r["deepnvme"][op]) / statistics.median(r["stock"][op])
                 for op in ("save", "load")}
        print(f"{case:10} {fmt(r['stock']['save']):>20} {fmt(r['deepnvme']['save']):>20} "
              f"{ratio['save']:>5.2f} {fmt(r['stock']['load']):>20} "
              f"{fmt(r['deepnvme']['load']):>20} {ratio['load']:>5.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
