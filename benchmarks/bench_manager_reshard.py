#!/usr/bin/env python3
"""CheckpointManager restore at another world size vs stock ``dcp.load`` (issue 27: resharded W -> W').

An MLP plus its AdamW state (``--state-mb`` in all, the same on every rank, as DDP replicas hold it)
is saved once by ``--world`` gloo ranks, twice: by ``deepnvme.CheckpointManager`` (its ``step-1``,
each replicated tensor written once, split across the ranks) and by stock
``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` (the same state dicts as
bench_manager_ranks.py's peer). Then ``--to`` ranks (1: one process without torch.distributed; more:
gloo) restore each cold (page cache dropped before every restore: needs root) into a fresh model
and optimizer: ``CheckpointManager(dir).restore(state)`` vs ``dcp.load`` + ``load_state_dict``, a
fresh job per restore, the order alternating, ``--reps`` of each; the time is the slowest rank's,
medians. Both restores are checked bitwise against the saved values.

    python -W ignore benchmarks/bench_manager_reshard.py --dir /mnt/ramdev2/rs --world 2 --to 1 \\
        --state-mb 1024 --reps 3 --json benchmarks/results/2026-11-29-manager-reshard-ramdev.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _volume_bench import loadavg

KINDS = ("deepnvme", "dcp")


def _job(args: argparse.Namespace) -> tuple[Any, Any]:
    """The same model and AdamW state on every rank (one step on the same batch)."""
    import torch

    torch.manual_seed(0)
    width = args.width
    layers = max(1, args.state_mb * 2**20 // 12 // (width * width + width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _zero(model: Any, opt: Any) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for s in opt.state.values():
            for v in s.values():
                v.zero_()


def _digest(model: Any, opt: Any) -> float:
    """A checksum of the parameters and moments (the same value on a bitwise restore)."""
    import torch

    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        total += p.double().sum()
    for s in opt.state.values():
        total += s["exp_avg"].double().sum() + s["exp_avg_sq"].double().abs().sum()
    return float(total)


def _init(rank: int, world: int, store: str) -> None:
    import torch
    import torch.distributed as dist
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))


def _save_main(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import deepnvme
    _init(rank, world, store)
    try:
        model, opt = _job(args)
        with deepnvme.CheckpointManager(os.path.join(args.dir, "deepnvme"), keep=None, rng=False) as mgr:
            mgr.save(1, {"model": model, "opt": opt})
        dcp.save({"model": model.state_dict(), "opt": opt.state_dict()},
                 storage_writer=dcp.FileSystemWriter(os.path.join(args.dir, "dcp")))
        if rank == 0:
            Path(out).write_text(json.dumps({"digest": _digest(model, opt)}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _restore_main(rank: int, world: int, store: str, args: argparse.Namespace, kind: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import deepnvme  # imported before the clock starts, as a training job has
    _init(rank, world, store)
    try:
        model, opt = _job(args)
        _zero(model, opt)
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        if kind == "deepnvme":
            mgr = deepnvme.CheckpointManager(os.path.join(args.dir, "deepnvme"), keep=None, rng=False)
            try:
                mgr.restore({"model": model, "opt": opt}, step=1)
            finally:
                mgr.close()
        else:
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            dcp.load(state, checkpoint_id=os.path.join(args.dir, "dcp"), no_dist=world == 1)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        seconds = time.perf_counter() - t0
        if world > 1:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, seconds)
            seconds = max(gathered)
        if rank == 0:
            Path(out).write_text(json.dumps({"seconds": seconds, "digest": _digest(model, opt)}))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _spawn(fn: Any, world: int, *args: Any) -> dict[str, Any]:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out, store = os.path.join(tmp, "out.json"), os.path.join(tmp, "store")
        mp.start_processes(fn, args=(world, store, *args, out), nprocs=world, start_method="spawn")
        return dict(json.loads(Path(out).read_text()))


def _drop_caches(enabled: bool) -> None:
    os.sync()
    if not enabled:
        return
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="folder on the device under test (its contents are replaced)")
    ap.add_argument("--device", default="", help="the device's name in the JSON")
    ap.add_argument("--world", type=int, default=2, help="ranks that save")
    ap.add_argument("--to", type=int, default=1, help="ranks that restore (1: no torch.distributed)")
    ap.add_argument("--state-mb", type=int, default=1024, help="parameters + AdamW state, MiB")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                    help="do not drop the page cache before each restore (warm: a smoke test without root)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    load_start = loadavg()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    saved = _spawn(_save_main, args.world, args)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for rep in range(args.reps):
        for kind in (KINDS if rep % 2 == 0 else KINDS[::-1]):
            _drop_caches(args.drop_caches)
            got = _spawn(_restore_main, args.to, args, kind)
            if got["digest"] != saved["digest"]:
                raise SystemExit(f"{kind} restored other values: digest {got['digest']} != {saved['digest']}")
            times[kind].append(got["seconds"])
            print(f"rep {rep + 1}: {kind} {got['seconds']:.3f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["dcp"] / med["deepnvme"]
    sizes = {k: sum(f.stat().st_size for f in Path(args.dir, k).rglob("*") if f.is_file()) for k in KINDS}
    print(f"restore {args.world} -> {args.to} ranks: deepnvme {med['deepnvme']:.3f} s, stock dcp.load "
          f"{med['dcp']:.3f} s: {ratio:.2f}x (target >= 1.0x: {'met' if ratio >= 1.0 else 'missed'})")
    load_end = loadavg()
    print(f"load average: {load_start} -> {load_end}")
    if args.json:
        import torch
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "device": args.device, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                               "torch": torch.__version__},
            "loadavg_start": load_start, "loadavg_end": load_end, "args": vars(args), "bytes": sizes,
            "restore_s": times, "median_s": med, "speedup_vs_dcp_load": ratio,
            "target_met": ratio >= 1.0}, indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
