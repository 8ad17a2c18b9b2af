"""Checkpointing every step of a CPU training loop: CheckpointManager against the stock ways.

Usage: flock /tmp/bench.lock python -W ignore benchmarks/bench_manager.py --dir DIR
       [--state-gb 1.0] [--steps 6] [--warmup 2] [--reps 2] [--batch 0] [--restore-reps 3]
       [--json out.json] [--volume DIR1,DIR2 [--timed-saves 3]]

``--volume`` (issue 30) runs instead the manager on ``--dir`` (a folder on DIR1's drive) against
the manager on ``deepnvme.Volume([DIR1, DIR2])``: see ``run_single`` in benchmarks/_volume_bench.py.

An MLP trained with Adam whose parameters plus optimizer state are ``--state-gb`` GB (params,
exp_avg, exp_avg_sq: 12 bytes a parameter). The batch is chosen (unless ``--batch``) so that one
training step takes about as long as writing one checkpoint. Configurations, run one after the
other in each repetition (order rotated every repetition), each saving every step into a fresh
directory under ``--dir`` that is deleted afterwards:

* ``none``: no checkpointing (the baseline step time);
* ``fenced``, ``snapshot``: ``deepnvme.CheckpointManager(staging=..., keep=1)``; ``snapshot2``
  and ``fenced_pre`` (only when named in ``--configs``): ``SnapshotStager(arenas=2)``,
  ``FencedStager(precopy=True)``;
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` (no process group: ``no_dist=True``)
  with ``DefaultStager(StagingOptions(use_pinned_memory=True, use_async_staging=True))``; the
  loop waits for the staging before ``optimizer.step()`` (a step pre-hook) and for the upload
  before the next save, as DCP's documentation asks, so the saved state is the step's;
* ``torch_thread``: the state is cloned in the loop, then ``torch.save`` runs in a thread; the
  next save first joins that thread.

Per configuration: the median step time (one iteration: forward, backward, optimizer step and
the save call), the time added per step over ``none``, and the training thread's blocked time
per save (the save call plus any wait it causes: fence, staging, previous save). Reference: a
plain memory copy of the state into preallocated buffers (``copy_`` per tensor). Restore: the
newest checkpoint loaded into the model and optimizer, cold cache (``drop_caches`` when root,
else ``posix_fadvise(DONTNEED)``), ``CheckpointManager.restore`` against ``torch.load`` (and
``torch.load(mmap=True)``) plus ``load_state_dict``, repetitions interleaved, each timed until
a read pass over every state tensor is done (so mmap's deferred reads are counted).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import deepnvme
from deepnvme.io.durable import wait_for_releases
from deepnvme.io.posix import evict_page_cache

CONFIGS = ("none", "fenced", "snapshot", "dcp_async", "torch_thread")
EXTRA_CONFIGS = ("snapshot2", "fenced_pre")  # run only when named in --configs


class Loop:
    """The model, optimizer and a fixed batch; ``step()`` is one training iteration."""

    def __init__(self, state_gb: float, batch: int) -> None:
        params = state_gb * 1e9 / 12
        self.width = int(min(4096, max(64, math.sqrt(params / 4))))
        layers = max(1, round(params / (self.width * self.width)))
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(self.width, self.width) for _ in range(layers)])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.set_batch(batch)
        self.step()  # Adam's state exists before the first save

    def set_batch(self, batch: int) -> None:
        self.batch = batch
        self.x = torch.randn(batch, self.width)

    def step(self) -> None:
        self.opt.zero_grad()
        self.model(self.x).square().mean().backward()
        self.opt.step()

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        out = [p.detach() for p in self.model.parameters()]
        for st in self.opt.state.values():
            out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        return out


def drop_cache(paths: list[str]) -> None:
    """Make the next read of ``paths`` cold: drop_caches as root, else fadvise each file."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    except OSError:
        pass
    for top in paths:
        for root, _, files in os.walk(top) if os.path.isdir(top) else [("", [], [top])]:
            for name in files:
                evict_page_cache(os.path.join(root, name))


class Saver:
    """One checkpointing configuration: ``save(step)`` from the loop; ``blocked`` per save."""

    def __init__(self, kind: str, loop: Loop, directory: str) -> None:
        self.kind, self.loop, self.directory = kind, loop, directory
        self.blocked: list[float] = []
        self.writes: list[float] = []
        self._extra = 0.0
        self._fence_seen = 0.0
        self.arena_wait: list[float] = []
        self.copied: list[int] = []  # fenced: bytes the fence copied, per save
        self._copied_seen = 0
        self._mgr: deepnvme.CheckpointManager | None = None
        self._hook: Any = None
        self._thread: threading.Thread | None = None
        self._resp: Any = None
        if kind in ("fenced", "fenced_pre", "snapshot", "snapshot2"):
            stager = (deepnvme.SnapshotStager(arenas=2 if kind == "snapshot2" else 1) if kind.startswith("snapshot")
                      else deepnvme.FencedStager(precopy=kind == "fenced_pre"))
            self._mgr = deepnvme.CheckpointManager(directory, keep=1, staging=stager, rng=False)
        if kind == "dcp_async":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=False))
            self._hook = loop.opt.register_step_pre_hook(self._wait_staging)

    def _wait_staging(self, *args: Any) -> None:
        if self._resp is not None and not self._resp.staging_completion.done():
            t0 = time.perf_counter()
            self._resp.staging_completion.result()
            self._extra += time.perf_counter() - t0

    def save(self, step: int) -> None:
        loop = self.loop
        if self.kind == "none":
            return
        t0 = time.perf_counter()
        if self._mgr is not None:
            before = self._mgr.stats.arena_wait_seconds
            self._mgr.save(step, {"model": loop.model, "opt": loop.opt})
            self.arena_wait.append(self._mgr.stats.arena_wait_seconds - before)
        elif self.kind == "dcp_async":
            import torch.distributed.checkpoint as dcp
            if self._resp is not None:
                self._resp.upload_completion.result()
            self._resp = dcp.async_save({"model": loop.model.state_dict(), "opt": loop.opt.state_dict()},
                                        checkpoint_id=os.path.join(self.directory, "dcp"),
                                        async_stager=self._stager, no_dist=True)
        else:
            if self._thread is not None:
                self._thread.join()
            state = {"model": {k: v.clone() for k, v in loop.model.state_dict().items()},
                     "opt": _clone(loop.opt.state_dict())}
            path = os.path.join(self.directory, "ck.pt")
            self._thread = threading.Thread(target=self._torch_save, args=(state, path))
            self._thread.start()
        self.blocked.append(time.perf_counter() - t0)

    def _torch_save(self, state: dict[str, Any], path: str) -> None:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        self.writes.append(time.perf_counter() - t0)

    def take_extra(self) -> float:
        """Waits outside the save call since the last call: DCP staging, the manager's fence."""
        if self._mgr is not None:
            stats = self._mgr.stats
            fence = stats.fence_wait_seconds
            self._extra, self._fence_seen = fence - self._fence_seen, fence
            if self.kind.startswith("fenced"):
                self.copied.append(stats.fence_copied_bytes - self._copied_seen)
                self._copied_seen = stats.fence_copied_bytes
        extra, self._extra = self._extra, 0.0
        return extra

    def finish(self) -> None:
        """Wait for the last save (untimed) and release everything."""
        if self._mgr is not None:
            self._mgr.close()
        if self._resp is not None:
            self._resp.upload_completion.result()
            self._stager.close()
        if self._hook is not None:
            self._hook.remove()
        if self._thread is not None:
            self._thread.join()


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def run_config(kind: str, loop: Loop, directory: str, *, steps: int, warmup: int) -> dict[str, Any]:
    """Train ``warmup + steps`` iterations saving every step; timings of the last ``steps``."""
    os.makedirs(directory, exist_ok=True)
    saver = Saver(kind, loop, directory)
    times, blocked, waits, copied = [], [], [], []
    try:
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            loop.step()
            saver.save(i)
            dt = time.perf_counter() - t0
            extra = saver.take_extra()  # waits inside this iteration's optimizer step (fence, staging)
            if i >= warmup:
                times.append(dt)
                blocked.append(saver.blocked[-1] + extra if saver.blocked else extra)
                waits.extend(saver.arena_wait[-1:])
                copied.extend(saver.copied[-1:])
    finally:
        saver.finish()
        shutil.rmtree(directory)
        wait_for_releases()
    return {"step_s": times, "blocked_s": blocked if kind != "none" else [],
            "write_s": saver.writes, "arena_wait_s": waits, "fence_copied_bytes": copied}


def plain_copy_seconds(loop: Loop, reps: int = 3) -> float:
    """Median time of copying every state tensor into preallocated buffers (``copy_``)."""
    srcs = loop.tensors()
    dsts = [torch.empty_like(t) for t in srcs]
    for d in dsts:
        d.fill_(0)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for d, s in zip(dsts, srcs):
            d.copy_(s)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def write_seconds(loop: Loop, directory: str, reps: int = 3) -> float:
    """Median of ``reps`` durable deepnvme.save calls of the state (after one untimed warm-up):
    the write time the step is sized against and the fenced target is computed from."""
    path = os.path.join(directory, "calibrate.pt")
    state = {"model": loop.model.state_dict(), "opt": loop.opt.state_dict()}
    out = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        deepnvme.save(state, path)
        if i:
            out.append(time.perf_counter() - t0)
        os.unlink(path)
        wait_for_releases()
    return statistics.median(out)


def calibrate_batch(loop: Loop, target: float) -> int:
    """The batch whose step takes about ``target`` seconds."""
    batch = 8
    for _ in range(3):
        loop.set_batch(batch)
        loop.step()
        t0 = time.perf_counter()
        loop.step()
        dt = time.perf_counter() - t0
        batch = max(1, round(batch * target / dt))
    return batch


def restore_bench(loop: Loop, directory: str, reps: int) -> dict[str, list[float]]:
    """Cold restores of the same state: CheckpointManager.restore vs torch.load + load_state_dict."""
    mdir, tpath = os.path.join(directory, "restore-mgr"), os.path.join(directory, "restore.pt")
    with deepnvme.CheckpointManager(mdir, keep=1, rng=False) as mgr:
        mgr.save(0, {"model": loop.model, "opt": loop.opt})
    torch.save({"model": loop.model.state_dict(), "opt": loop.opt.state_dict()}, tpath)
    reader = deepnvme.CheckpointManager(mdir, rng=False)

    def stock(mmap: bool) -> Callable[[], None]:
        def run() -> None:
            sd = torch.load(tpath, weights_only=True, mmap=mmap)
            loop.model.load_state_dict(sd["model"])
            loop.opt.load_state_dict(sd["opt"])
        return run

    cases: dict[str, Callable[[], Any]] = {
        "deepnvme_restore": lambda: reader.restore({"model": loop.model, "opt": loop.opt}),
        "torch_load": stock(False), "torch_load_mmap": stock(True)}
    out: dict[str, list[float]] = {k: [] for k in cases}
    try:
        for r in range(reps):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for name in order:
                gc.collect()  # a torch.load(mmap=True) result in a reference cycle keeps its pages mapped
                drop_cache([mdir, tpath])
                t0 = time.perf_counter()
                cases[name]()
                for t in loop.tensors():  # every byte in memory (mmap reads lazily until here)
                    t.sum()
                out[name].append(time.perf_counter() - t0)
                for st in loop.opt.state.values():  # untimed: no state stays file-mapped, so
                    for k, v in st.items():         # the next drop_cache really empties the cache
                        st[k] = v.clone()
    finally:
        reader.close()
        shutil.rmtree(mdir)
        os.unlink(tpath)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--state-gb", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=0, help="0: sized so a step takes about one write")
    ap.add_argument("--restore-reps", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json")
    ap.add_argument("--volume", help="DIR1,DIR2: the manager on --dir vs on a Volume of these folders")
    ap.add_argument("--timed-saves", type=int, default=3, help="with --volume: saves timed until committed")
    args = ap.parse_args()
    base = os.path.join(os.path.abspath(args.dir), f"bench-manager-{os.getpid()}")
    os.makedirs(base)
    try:
        result = run_volume(args, base) if args.volume else run(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    loop = Loop(args.state_gb, max(1, args.batch or 8))
    nbytes = loop.state_bytes()
    write = write_seconds(loop, base)
    if not args.batch:
        loop.set_batch(calibrate_batch(loop, write))
    configs = [c for c in args.configs.split(",") if c]
    runs: dict[str, dict[str, list[float]]] = {
        c: {"step_s": [], "blocked_s": [], "write_s": [], "arena_wait_s": [], "fence_copied_bytes": []}
        for c in configs}
    for rep in range(args.reps):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        for kind in order:
            got = run_config(kind, loop, os.path.join(base, kind), steps=args.steps, warmup=args.warmup)
            for k, v in got.items():
                runs[kind][k].extend(v)
    copy = plain_copy_seconds(loop)
    restore = restore_bench(loop, base, args.restore_reps) if args.restore_reps else {}
    return report(args, loop, nbytes, write, copy, runs, restore)


def run_volume(args: argparse.Namespace, base: str) -> dict[str, Any]:
    """``--volume``: the manager on ``base`` vs on the volume (``_volume_bench.run_single``)."""
    from _volume_bench import drive_paths, loadavg, run_single

    start = loadavg()
    print(f"load average at start: {start}", flush=True)
    loop = Loop(args.state_gb, max(1, args.batch or 8))
    write = write_seconds(loop, base)
    if not args.batch:
        loop.set_batch(calibrate_batch(loop, write))
    print(f"state {loop.state_bytes() / 1e9:.2f} GB, batch {loop.batch}, one durable write {write:.3f} s", flush=True)
    out = run_single(loop, base, drive_paths(args.volume), drop_cache, reps=args.reps, steps=args.steps,
                     warmup=args.warmup, timed=args.timed_saves)
    end = loadavg()
    print(f"load average at end: {end}")
    return {"command_args": vars(args), "state_bytes": loop.state_bytes(), "width": loop.width, "batch": loop.batch,
            "write_s": write, "loadavg_start": start, "loadavg_end": end, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), **out}


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(args: argparse.Namespace, loop: Loop, nbytes: int, write: float, copy: float,
           runs: dict[str, dict[str, list[float]]], restore: dict[str, list[float]]) -> dict[str, Any]:
    base_step = _med(runs["none"]["step_s"]) if "none" in runs else float("nan")
    print(f"state {nbytes / 1e9:.2f} GB (MLP {loop.width} wide, Adam), batch {loop.batch}; "
          f"one durable write {write:.3f} s; baseline step {base_step:.3f} s; plain memory copy {copy:.3f} s")
    print(f"{'config':<14}{'step s':>9}{'added s':>9}{'added %':>9}{'blocked s':>11}{'blocked %':>11}")
    rows = {}
    for kind, r in runs.items():
        step = _med(r["step_s"])
        blocked = _med(r["blocked_s"]) if r["blocked_s"] else 0.0
        added = step - base_step
        rows[kind] = {"step_s": step, "added_s": added, "blocked_s": blocked,
                      "step_samples": r["step_s"], "blocked_samples": r["blocked_s"]}
        print(f"{kind:<14}{step:>9.3f}{added:>9.3f}{added / base_step:>9.1%}{blocked:>11.4f}"
              f"{blocked / base_step:>11.1%}")
    targets: dict[str, Any] = {}
    for fk in ("fenced", "fenced_pre"):
        if fk not in rows:
            continue
        copied = runs[fk]["fence_copied_bytes"]
        rows[fk]["fence_copied_bytes"] = copied
        if copied:
            print(f"{fk}: the fence copied {_med([float(c) for c in copied]) / 1e6:.0f} MB per save (median; "
                  f"{sum(1 for c in copied if c)} of {len(copied)} saves copied)")
        allowed = max(0.0, write - base_step) + 0.03 * base_step
        targets[f"{fk}_added_s"] = {"value": rows[fk]["added_s"], "limit": allowed}
        targets[f"{fk}_blocked_fraction"] = {"value": rows[fk]["blocked_s"] / base_step, "limit": 0.02}
    for snap in ("snapshot", "snapshot2"):
        if snap not in rows:
            continue
        waits = runs[snap]["arena_wait_s"]
        own = _med([b - w for b, w in zip(runs[snap]["blocked_s"], waits)])
        rows[snap]["blocked_without_arena_wait_s"] = own
        print(f"{snap}: blocked {rows[snap]['blocked_s']:.4f} s median, of which waiting for the "
              f"previous write {_med(waits):.4f} s; without that wait {own:.4f} s")
        targets[f"{snap}_blocked_over_copy"] = {"value": rows[snap]["blocked_s"] / copy, "limit": 1.1}
        targets[f"{snap}_blocked_no_wait_over_copy"] = {"value": own / copy, "limit": 1.1}
    if "dcp_async" in rows:
        dcp_added = rows["dcp_async"]["added_s"]
        for kind in ("fenced", "fenced_pre", "snapshot", "snapshot2"):
            if kind in rows:
                targets[f"{kind}_added_over_dcp"] = {"value": rows[kind]["added_s"] / dcp_added, "limit": 0.5}
    rest = {k: _med(v) for k, v in restore.items()}
    if rest:
        stock = min(rest["torch_load"], rest["torch_load_mmap"])
        print("restore (cold): " + ", ".join(f"{k} {v:.3f} s" for k, v in rest.items()))
        targets["restore_speedup_vs_stock"] = {"value": stock / rest["deepnvme_restore"], "limit": 1.0,
                                               "higher_is_better": True}
    print("targets:")
    for name, t in targets.items():
        ok = t["value"] >= t["limit"] if t.get("higher_is_better") else t["value"] <= t["limit"]
        t["met"] = ok
        print(f"  {name:<28} {t['value']:.3f} (limit {t['limit']:.3f}) {'met' if ok else 'MISSED'}")
    return {"command_args": vars(args), "state_bytes": nbytes, "width": loop.width, "batch": loop.batch,
            "write_s": write, "baseline_step_s": base_step, "plain_copy_s": copy, "configs": rows,
            "restore_s": restore, "restore_median_s": rest, "targets": targets,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


if __name__ == "__main__":
    main()
