#!/usr/bin/env python3
"""CheckpointManager across gloo ranks: commit agreement latency and resident memory over many saves.

``--world`` gloo ranks (``OMP_NUM_THREADS=1``) each hold the same small MLP under DDP plus AdamW
state (``--state-mb`` per rank) and save every step for ``--saves`` steps (``keep=2``). Measured
per save on every rank: the commit agreement (the writer thread's two exchanges: the vote on every
rank's write, then rank 0's outcome, timed from the last rank's vote to the last rank hearing the
outcome, less rank 0's file work in between), the caller's step vote, and the process's resident memory
(``/proc/self/statm``) after each save; reported as medians/maxima over ranks and the growth of
resident memory from save ``--settle`` to the last.

    python -W ignore benchmarks/bench_manager_commit.py --dir /work/tmpbench/commit --world 4 \\
        --saves 100 --json benchmarks/results/2026-11-27-manager-commit.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import deepnvme

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        torch.manual_seed(0)
        width = 256
        layers = max(1, args.state_mb * 2**20 // 12 // (width * width + width))
        net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        model = DistributedDataParallel(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        batch = torch.randn(8, width)
        mgr = deepnvme.CheckpointManager(args.dir, keep=2, rng=False, timeout=300)
        ranks = mgr._ranks
        times: dict[str, list[float]] = {"step_vote": []}
        spans: dict[str, list[tuple[float, float]]] = {"vote": [], "commit": []}
        group = ranks.group

        def timed(method: Any) -> Any:
            def call(obj: Any, *, thread: str, what: str) -> Any:
                t0 = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process of the machine
                got = method(obj, thread=thread, what=what)
                t1 = time.perf_counter()
                kind = "vote" if what.endswith(" vote") else "commit" if what.endswith(" commit") else None
                if kind is not None:
                    spans[kind].append((t0, t1))
                elif what.startswith("save(") and what.endswith(")"):
                    times["step_vote"].append(t1 - t0)
                return got
            return call

        for name in ("gather", "collect", "announce"):
            if hasattr(group, name):
                setattr(group, name, timed(getattr(group, name)))
        rss: list[int] = []
        for step in range(1, args.saves + 1):
            opt.zero_grad()
            model(batch).square().mean().backward()
            opt.step()
            mgr.save(step, {"model": net, "optim": opt})
            mgr.wait()
            rss.append(_rss())
        mgr.close()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {"times": times, "spans": spans, "rss": rss, "planned": ranks.plans.planned})
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def summarize(ranks: list[dict[str, Any]], settle: int) -> dict[str, Any]:
    """Per save, the commit agreement: from the moment the last rank starts its vote until the
    last rank has heard the outcome, less what rank 0 does in between (writing the metadata and
    manifest, the rename: file work, not agreement). Also the same span with the wait for the
    slowest rank's write included (from the first rank's vote)."""
    med = statistics.median
    n = len(ranks[0]["spans"]["vote"])
    agree, first = [], []
    for i in range(n):
        votes = [r["spans"]["vote"][i] for r in ranks]
        commits = [r["spans"]["commit"][i] for r in ranks]
        publish = commits[0][0] - votes[0][1]  # rank 0: between hearing the votes and announcing
        end = max(c[1] for c in commits)
        agree.append(end - max(v[0] for v in votes) - publish)
        first.append(end - min(v[0] for v in votes) - publish)
    step_vote = [min(r["times"]["step_vote"][i] for r in ranks) for i in range(n)]
    growth = max((r["rss"][-1] - r["rss"][settle - 1]) / r["rss"][settle - 1] for r in ranks)
    return {"agreement_ms_median": 1e3 * med(agree), "agreement_ms_p90": 1e3 * sorted(agree)[int(0.9 * n)],
            "agreement_with_slowest_write_ms_median": 1e3 * med(first),
            "step_vote_ms_median": 1e3 * med(step_vote), "rss_growth_after_settle": growth,
            "rss_mb_last": [r["rss"][-1] / 2**20 for r in ranks], "planned": [r["planned"] for r in ranks],
            "targets_met": {"agreement <= 10 ms": 1e3 * med(agree) <= 10, "rss growth < 1%": growth < 0.01}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--saves", type=int, default=100)
    ap.add_argument("--settle", type=int, default=10, help="saves before resident memory is compared")
    ap.add_argument("--state-mb", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    shutil.rmtree(args.dir, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_rank_main, args=(args.world, os.path.join(tmp, "store"), args, out),
                           nprocs=args.world, start_method="spawn")
        ranks = json.loads(Path(out).read_text())
    shutil.rmtree(args.dir, ignore_errors=True)
    summary = summarize(ranks, args.settle)
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "command": shlex.join([os.path.basename(sys.executable), *sys.argv]), "args": vars(args),
            "cpus": os.cpu_count(), "summary": summary, "ranks": ranks}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
