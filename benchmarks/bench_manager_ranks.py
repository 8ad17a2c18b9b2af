#!/usr/bin/env python3
"""CheckpointManager across gloo ranks vs stock DCP ``async_save``: a save every step of a DDP job.

Each repetition spawns ``--world`` gloo ranks (``OMP_NUM_THREADS=1``, ``OMP_WAIT_POLICY=PASSIVE``).
Every rank holds the same MLP under ``DistributedDataParallel`` plus its AdamW state (``--state-mb``
per rank: parameters + two moments), trains on random batches and runs, in an order rotated each
repetition, these savers for ``--warmup`` + ``--steps`` steps each:

* ``none``: no checkpoint (the baseline step time);
* ``deepnvme``: ``deepnvme.CheckpointManager(dir, staging="snapshot")`` over the world, a save every step;
* ``deepnvme_fenced``: the same with ``staging="fenced"`` (no copy at ``save()``; the next optimizer step
  copies what is not written yet); its time blocked per save is the ``save()`` call plus the fence's
  wait at the next optimizer step;
* ``copy``: no checkpoint, but at the save's place in the loop a plain copy (deepnvme's ``ParallelCopy``)
  of 1/W of the state into memory kept from step to step: what a snapshot's copy of this rank's share
  costs in this loop, with the other ranks copying theirs at the same time (the denominator of the
  snapshot's blocked-time target; ``share_copy_s`` is the same copy in the parent alone);
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` with ``FileSystemWriter``, a persistent
  ``DefaultStager(StagingOptions(True, True, True, False))`` (pinned memory, shared memory, async
  staging; torchtitan's non-blocking copy needs an accelerator), ``AsyncCheckpointerType.PROCESS``
  (``--dcp-checkpointer``) and a gloo group of its own, as torchtitan's ``async_with_pinned_mem`` mode
  runs it: the optimizer step waits for the previous staging, and a save waits for the previous upload.

Measured per saver (medians over steps and ranks' maxima): step time, time added over ``none``,
time blocked in the loop per save (the save call plus waits), the bytes of one saved step in all
and per rank; then a cold restore of each saver's newest step at the same world size (page cache
dropped before each: needs root; ``--no-drop-caches`` for a warm smoke test): ``restore`` vs
``dcp.load`` + ``load_state_dict``. Results, the issue's target ratios included, go to ``--json``.

``--volume DIR1,DIR2`` (issue 30) adds ``deepnvme_volume`` / ``deepnvme_fenced_volume``: the same
managers on ``deepnvme.Volume([DIR1, DIR2])``, whose data files are placed across the drives by bytes
(default savers then: ``none,deepnvme,deepnvme_volume``; point ``--dir`` at a folder on DIR1's drive
for the one-drive side). Each manager saver also times ``--timed-saves`` saves of their own after
the loop (``save()`` then ``wait()``: the time until the step is committed, max over ranks), and the
bytes of the newest step per drive are reported.

    python -W ignore benchmarks/bench_manager_ranks.py --dir /mnt/ramdev0/one \\
        --volume /mnt/ramdev0,/mnt/ramdev1 --json benchmarks/results/2026-11-29-manager-volume-ranks.json

    python -W ignore benchmarks/bench_manager_ranks.py --dir /work/tmpbench/mr --state-mb 256 \\
        --json benchmarks/results/2026-11-27-manager-ranks-disk.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _volume_bench import drive_paths, loadavg, manager_target, remove_target, step_files

SAVERS = ("none", "deepnvme", "deepnvme_fenced", "dcp_async")
EXTRA_SAVERS = ("copy",)  # by --savers only
VOLUME_SAVERS = ("deepnvme_volume", "deepnvme_fenced_volume")  # with --volume
MANAGERS = ("deepnvme", "deepnvme_fenced", *VOLUME_SAVERS)
TARGETS = {"added_vs_dcp_max": 0.5, "restore_speedup_min": 1.2, "bytes_per_state": 1.0, "largest_share_max": 1.1}


def _rank_of(name: str, world: int) -> int | None:
    """The rank that wrote a data file: DCP's ``__R_0.distcp``, deepnvme's per-rank names (``rank-R`` / ``__R_``)."""
    base = os.path.basename(name)
    for r in range(world):
        if base.startswith(f"__{r}_") or f"rank-{r}." in base or f"rank{r}." in base or f"rank-{r}-" in base:
            return r
    return None


def _drop_caches(enabled: bool) -> None:
    os.sync()
    if enabled:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


class Job:
    """One rank's model, optimizer and data."""

    def __init__(self, rank: int, args: argparse.Namespace) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        width = args.width
        params = max(1, args.state_mb * 2**20 // 12 // (width * width + width))  # 4 B params + 8 B AdamW moments
        self.module = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(params)])
        self.ddp = DistributedDataParallel(self.module)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-5)
        self.batch = torch.randn(args.batch, width, generator=torch.Generator().manual_seed(rank))
        self.state_bytes = 3 * sum(p.numel() * p.element_size() for p in self.module.parameters())
        self.step()  # AdamW state exists from here on

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        self.ddp(self.batch).square().mean().backward()
        self.opt.step()


class Saver:
    def __init__(self, kind: str, job: Job, directory: Path, checkpointer: str, target: Any = None) -> None:
        self.kind, self.job, self.directory, self.checkpointer = kind, job, directory, checkpointer
        self.target = directory if target is None else target  # a manager's folder: on a volume, vol / name
        self.blocked: list[float] = []
        self.fenced: list[float] = []  # deepnvme: each save's fence wait at the next optimizer step
        self._staging_wait = 0.0
        self._resp: Any = None
        self._mgr: Any = None
        self.last: Path | None = None
        self._fence_seen = 0.0
        if kind in MANAGERS:
            import deepnvme
            self._mgr = deepnvme.CheckpointManager(self.target, keep=2, rng=False,
                                                   staging="fenced" if "fenced" in kind else "snapshot")
        elif kind == "copy":
            import torch
            import torch.distributed as dist
            share = job.state_bytes // dist.get_world_size()
            self._src = torch.ones(share, dtype=torch.uint8)  # stands for the share's tensors
            self._dst = torch.zeros(share, dtype=torch.uint8)  # the reused, touched staging memory
        elif kind == "dcp_async":
            import torch.distributed as dist
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            self._pg = dist.new_group(backend="gloo")
            # torchtitan's options but the non-blocking copy, which needs an accelerator
            self._stager = DefaultStager(StagingOptions(True, True, True, False))
            self._hook = job.opt.register_step_pre_hook(self._wait_staging)

    def _wait_staging(self, *_: Any) -> None:
        if self._resp is not None and not self._resp.staging_completion.done():
            t0 = time.perf_counter()
            self._resp.staging_completion.result()
            self._staging_wait += time.perf_counter() - t0

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        if self._mgr is not None:
            fence = self._mgr.stats.fence_wait_seconds  # the previous save's fence, at this step's optimizer step
            if self.blocked:
                self.blocked[-1] += fence - self._fence_seen
                self.fenced.append(fence - self._fence_seen)
            self._fence_seen = fence
            self._mgr.save(step, {"model": self.job.module, "opt": self.job.opt})
        elif self.kind == "copy":
            from deepnvme.memory.copy import ParallelCopy
            copy = ParallelCopy()
            copy.add(self._dst, self._src)
            copy.finish()
        elif self.kind == "dcp_async":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
            if self._resp is not None:
                self._resp.upload_completion.result()
            self.last = self.directory / f"step-{step}"
            self._resp = dcp.async_save(
                {"model": self.job.module.state_dict(), "opt": self.job.opt.state_dict()},
                storage_writer=dcp.FileSystemWriter(str(self.last)), process_group=self._pg,
                async_checkpointer_type=AsyncCheckpointerType(self.checkpointer), async_stager=self._stager)
        else:
            return
        self.blocked.append(time.perf_counter() - t0 + self._staging_wait)
        self._staging_wait = 0.0

    def timed_saves(self, first: int, count: int) -> list[float]:
        """``count`` saves, each followed by ``wait()``: seconds until each step is committed."""
        import torch.distributed as dist
        out = []
        for step in range(first, first + count):
            dist.barrier()
            t0 = time.perf_counter()
            self._mgr.save(step, {"model": self.job.module, "opt": self.job.opt})
            self._mgr.wait()
            out.append(time.perf_counter() - t0)
        return out

    def finish(self) -> Path | None:
        """Wait for the last save; return the newest step's directory."""
        if self._mgr is not None:
            self._mgr.close()
            steps = sorted(self.directory.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
            return steps[-1] if steps else None
        if self.kind == "dcp_async":
            if self._resp is not None:
                self._resp.upload_completion.result()
            self._hook.remove()
            self._stager.close()
            return self.last
        return None

    def restore(self, job: Job, step_dir: Path) -> None:
        if self.kind in MANAGERS:
            import deepnvme
            mgr = deepnvme.CheckpointManager(self.target, keep=2, staging="snapshot", rng=False)
            try:
                mgr.restore({"model": job.module, "opt": job.opt})
            finally:
                mgr.close()
        else:
            import torch.distributed.checkpoint as dcp
            state = {"model": job.module.state_dict(), "opt": job.opt.state_dict()}
            dcp.load(state, checkpoint_id=str(step_dir))
            job.module.load_state_dict(state["model"])
            job.opt.load_state_dict(state["opt"])


def _rank_main(rank: int, world: int, store: str, args: argparse.Namespace, order: list[str], out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        job = Job(rank, args)
        result: dict[str, Any] = {"state_bytes": job.state_bytes}
        for kind in order:
            paths = args.volume_paths if kind in VOLUME_SAVERS else None
            directory = Path(paths[0] if paths else args.dir) / f"{kind}"  # drive 0's folder on a volume
            if rank == 0:
                remove_target(paths, args.dir, kind)
                directory.mkdir(parents=True)
            dist.barrier()
            saver = Saver(kind, job, directory, args.dcp_checkpointer, manager_target(paths, args.dir, kind))
            steps: list[float] = []
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                job.step()
                saver.save(i + 1)
                if i >= args.warmup:
                    steps.append(time.perf_counter() - t0)
            timed = saver.timed_saves(args.warmup + args.steps + 1, args.timed_saves) if kind in MANAGERS else []
            last = saver.finish()
            dist.barrier()
            rec: dict[str, Any] = {"step_s": steps, "blocked_s": saver.blocked[args.warmup:],
                                   "fence_s": saver.fenced[args.warmup:], "save_s": timed}
            if last is not None:
                total, files, per_drive = step_files(paths, args.dir, kind, last.name)
                rec.update(step_dir=str(last), bytes=total, files=files, bytes_per_drive=per_drive)
                if rank == 0:
                    _drop_caches(args.drop_caches)
                dist.barrier()
                t0 = time.perf_counter()
                saver.restore(job, last)
                rec["restore_s"] = time.perf_counter() - t0
                dist.barrier()
            result[kind] = rec
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def _one_rep(args: argparse.Namespace, order: list[str]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out, store = os.path.join(tmp, "out.json"), os.path.join(tmp, "store")
        mp.start_processes(_rank_main, args=(args.world, store, args, order, out), nprocs=args.world,
                           start_method="spawn")
        return list(json.loads(Path(out).read_text()))


def _summary(reps: list[list[dict[str, Any]]], world: int, savers: list[str]) -> dict[str, Any]:
    med = statistics.median
    out: dict[str, Any] = {}
    for kind in savers:
        # a step lasts as long as its slowest rank: per step the maximum over ranks, then the median
        steps = [max(r[kind]["step_s"][i] for r in rep) for rep in reps for i in range(len(rep[0][kind]["step_s"]))]
        c: dict[str, Any] = {"step_s": med(steps)}
        if kind == "copy":
            c["blocked_s"] = med([max(r[kind]["blocked_s"][i] for r in rep) for rep in reps
                                  for i in range(len(rep[0][kind]["blocked_s"]))])
        elif kind != "none":
            blocked = [max(r[kind]["blocked_s"][i] for r in rep) for rep in reps
                       for i in range(len(rep[0][kind]["blocked_s"]))]
            restores = [max(r[kind]["restore_s"] for r in rep) for rep in reps]
            last = reps[-1][0][kind]
            per_rank = [0] * world
            for name, size in last["files"].items():
                owner = _rank_of(name, world)
                if owner is not None:
                    per_rank[owner] += size
            saves = [max(r[kind]["save_s"][i] for r in rep) for rep in reps for i in range(len(rep[0][kind]["save_s"]))]
            c.update(blocked_s=med(blocked), restore_s=med(restores), restore_reps=restores,
                     save_s=med(saves) if saves else None, save_reps=saves, bytes_per_drive=last["bytes_per_drive"],
                     bytes_per_save=last["bytes"], bytes_per_rank=per_rank, files=last["files"],
                     largest_share_over_mean=(max(per_rank) / statistics.mean(per_rank)) if any(per_rank) else None)
        out[kind] = c
    base = out["none"]["step_s"]
    for kind in savers[1:]:
        out[kind]["added_s"] = out[kind]["step_s"] - base
    return out


def share_copy_seconds(nbytes: int, reps: int = 5) -> float:
    """Median seconds of one plain copy of ``nbytes`` (the largest rank's share) into memory already
    touched, with deepnvme's ParallelCopy, in this process alone (the ranks' snapshots copy both
    shares at once on the same cores, so the ratio to it is a conservative one)."""
    import torch

    from deepnvme.memory.copy import ParallelCopy

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy = ParallelCopy()
        copy.add(dst, src)
        copy.finish()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="folder on the device under test (its contents are replaced)")
    ap.add_argument("--device", default="", help="the device's name in the JSON (e.g. 'development disk')")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--state-mb", type=int, default=256, help="parameters + AdamW state per rank, MiB")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dcp-checkpointer", choices=("process", "thread"), default="process",
                    help="DCP's async_checkpointer_type (torchtitan: process; thread starts faster, for smoke tests)")
    ap.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                    help="restore warm (no root needed): for smoke tests")
    ap.add_argument("--savers", help=f"comma-separated, 'none' first (default: {','.join(SAVERS)}; "
                    "with --volume: none,deepnvme,deepnvme_volume)")
    ap.add_argument("--volume", help="DIR1,DIR2: adds the managers on deepnvme.Volume of these drive folders")
    ap.add_argument("--timed-saves", type=int, default=3, help="per manager saver: saves timed until committed")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.drop_caches and os.geteuid() != 0:
        ap.error("dropping the page cache needs root; run as root or pass --no-drop-caches")
    try:
        args.volume_paths = drive_paths(args.volume) if args.volume else None
    except ValueError as exc:
        ap.error(str(exc))
    known = SAVERS + EXTRA_SAVERS + (VOLUME_SAVERS if args.volume else ())
    savers = (args.savers or (",".join(SAVERS) if not args.volume else "none,deepnvme,deepnvme_volume")).split(",")
    if savers[0] != "none" or not set(savers) <= set(known) or len(set(savers)) != len(savers):
        ap.error(f"--savers: distinct names of {known}, 'none' first")
    load_start = loadavg()
    print(f"load average at start: {load_start}", flush=True)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    reps = []
    for rep in range(args.reps):
        order = savers[rep % len(savers):] + savers[:rep % len(savers)]
        t0 = time.perf_counter()
        reps.append(_one_rep(args, order))
        print(f"rep {rep + 1}/{args.reps} ({', '.join(order)}): {time.perf_counter() - t0:.1f} s", flush=True)
    summary = _summary(reps, args.world, savers)
    state = reps[0][0]["state_bytes"]
    d, n, f = summary.get("deepnvme"), summary.get("dcp_async"), summary.get("deepnvme_fenced")
    ratios: dict[str, Any] = {}
    met: dict[str, bool] = {}
    if d is not None:
        ratios.update(bytes_per_save_over_state=d["bytes_per_save"] / state,
                      largest_share_over_mean=d["largest_share_over_mean"])
        met["bytes_per_save 1.0x state"] = abs(ratios["bytes_per_save_over_state"] - 1.0) <= 0.02
        met["largest_share <= 1.1x mean"] = (d["largest_share_over_mean"] or 99) <= 1.1
    if d is not None and n is not None:
        ratios.update(added_vs_dcp=d["added_s"] / n["added_s"] if n["added_s"] > 0 else None,
                      blocked_vs_dcp=d["blocked_s"] / n["blocked_s"],
                      restore_speedup_vs_dcp_load=n["restore_s"] / d["restore_s"],
                      dcp_bytes_per_save_over_state=n["bytes_per_save"] / state)
        met["added_vs_dcp <= 0.5"] = ratios["added_vs_dcp"] is not None and ratios["added_vs_dcp"] <= 0.5
        met["restore_speedup >= 1.2"] = ratios["restore_speedup_vs_dcp_load"] >= 1.2
    if d is not None and d["bytes_per_rank"]:
        ratios["share_copy_s"] = share_copy_seconds(max(d["bytes_per_rank"]))
        ratios["snapshot_blocked_over_share_copy"] = d["blocked_s"] / ratios["share_copy_s"]
        met["snapshot blocked <= 1.1x the share's copy"] = ratios["snapshot_blocked_over_share_copy"] <= 1.1
        if (c := summary.get("copy")) is not None:  # the same copy in the same loop, every rank copying
            ratios["copy_in_loop_s"] = c["blocked_s"]
            ratios["snapshot_blocked_over_copy_in_loop"] = d["blocked_s"] / c["blocked_s"]
            met["snapshot blocked <= 1.1x the share's copy in the loop"] = \
                ratios["snapshot_blocked_over_copy_in_loop"] <= 1.1
    if f is not None:
        ratios["fenced_blocked_over_step"] = f["blocked_s"] / f["step_s"]
        met["fenced blocked < 2 % of a step"] = ratios["fenced_blocked_over_step"] < 0.02
        if d is not None:
            ratios["fenced_blocked_vs_snapshot"] = f["blocked_s"] / d["blocked_s"]
            ratios["fenced_added_vs_snapshot"] = f["added_s"] / d["added_s"] if d["added_s"] > 0 else None
        if n is not None:
            ratios["fenced_added_vs_dcp"] = f["added_s"] / n["added_s"] if n["added_s"] > 0 else None
    for kind in savers:
        c = summary[kind]
        extra = "" if kind == "none" else f"  blocked {c['blocked_s']:.3f} s" if kind == "copy" else (
            f"  added {c['added_s']:.3f} s  blocked {c['blocked_s']:.3f} s  bytes {c['bytes_per_save'] / 1e6:.0f} MB "
            f"per rank {[round(b / 1e6) for b in c['bytes_per_rank']]}  restore (cold) {c['restore_s']:.3f} s")
        print(f"{kind:10s} step {c['step_s']:.3f} s{extra}")
    for k, v in ratios.items():
        print(f"{k}: {v if v is None else round(v, 3)}")
    for one, vol in (("deepnvme", "deepnvme_volume"), ("deepnvme_fenced", "deepnvme_fenced_volume")):
        a, b = summary.get(one), summary.get(vol)
        if a is None or b is None:
            continue
        ratios[f"{vol}_save_speedup"] = a["save_s"] / b["save_s"] if a["save_s"] and b["save_s"] else None
        ratios[f"{vol}_restore_speedup"] = a["restore_s"] / b["restore_s"]
        ratios[f"{vol}_blocked_ratio"] = b["blocked_s"] / a["blocked_s"] if a["blocked_s"] > 0 else None
        ratios[f"{vol}_added_ratio"] = b["added_s"] / a["added_s"] if a["added_s"] > 0 else None
        ratios[f"{vol}_largest_drive_share"] = max(b["bytes_per_drive"]) / sum(b["bytes_per_drive"])
    for kind in savers[1:]:
        c = summary[kind]
        if c.get("save_s"):
            gbs, rgbs = c["bytes_per_save"] / c["save_s"] / 1e9, c["bytes_per_save"] / c["restore_s"] / 1e9
            print(f"{kind}: save until committed {c['save_s']:.3f} s ({gbs:.2f} GB/s), cold restore {rgbs:.2f} GB/s, "
                  f"bytes per drive {[round(b / 1e6) for b in c['bytes_per_drive']]} MB")
    for k, v in met.items():
        print(f"target {k}: {'met' if v else 'missed'}")
    load_end = loadavg()
    print(f"load average at end: {load_end}")
    if args.json:
        import torch
        machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                   "torch": torch.__version__, "processor": platform.processor()}
        try:
            machine["model"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                    if line.startswith("model name"))
            machine["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        except (OSError, StopIteration, ValueError):
            pass
        Path(args.json).write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "command": shlex.join([os.path.basename(sys.executable), *sys.argv]), "device": args.device,
            "machine": machine, "loadavg_start": load_start, "loadavg_end": load_end, "args": vars(args),
            "state_bytes": state, "configs": summary, "ratios": ratios, "targets": TARGETS, "targets_met": met,
            "reps": reps}, indent=1) + "\n")
    for kind in savers:  # the checkpoints go; the folder too when nothing else is in it
        remove_target(args.volume_paths if kind in VOLUME_SAVERS else None, args.dir, kind)
    if not os.listdir(args.dir):
        os.rmdir(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
