"""Helpers the manager benchmarks share for ``--volume DIR1,DIR2``: a CheckpointManager on a
:class:`deepnvme.Volume` of those drive folders against the same manager on the first folder alone.

A manager folder ``name`` on the volume is ``DIRd/name`` on each drive d; a step's files lie in
``DIRd/name/step-N`` (drive 0's folder holds the manifest and, for DCP steps, ``.metadata``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["drive_paths", "loadavg", "manager_target", "remove_target", "run_single", "step_files"]


def drive_paths(arg: str) -> list[str]:
    """The drive folders of ``--volume DIR1,DIR2`` (absolute, at least two, distinct)."""
    paths = [os.path.abspath(p) for p in arg.split(",") if p]
    if len(paths) < 2 or len(set(paths)) != len(paths):
        raise ValueError(f"--volume: two or more distinct folders, comma-separated (got {arg!r})")
    return paths


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg prints them."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def manager_target(paths: list[str] | None, folder: str | Path, name: str) -> Any:
    """Where a manager named ``name`` saves: ``Volume(paths) / name``, else ``folder / name``."""
    if paths is None:
        return Path(folder) / name
    import deepnvme

    return deepnvme.Volume(paths) / name


def remove_target(paths: list[str] | None, folder: str | Path, name: str) -> None:
    """Delete a manager folder (on a volume: its folder on every drive)."""
    for top in paths if paths is not None else [str(folder)]:
        shutil.rmtree(os.path.join(top, name), ignore_errors=True)


def step_files(
    paths: list[str] | None, folder: str | Path, name: str, step: str
) -> tuple[int, dict[str, int], list[int]]:
    """The files of manager ``name``'s step folder ``step`` (``step-N``): total bytes, relative
    name -> bytes (``d<drive>/...`` on a volume) and bytes per drive (one entry off a volume)."""
    tops = paths if paths is not None else [str(folder)]
    files: dict[str, int] = {}
    per_drive = []
    for d, top in enumerate(tops):
        root = Path(top) / name / step
        here = (
            {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}
            if root.is_dir()
            else {}
        )
        per_drive.append(sum(here.values()))
        files.update({(f"d{d}/{k}" if paths is not None else k): v for k, v in here.items()})
    return sum(per_drive), files, per_drive


def _step(step: int) -> str:
    return f"step-{step:012d}"


def _drive_of(paths: list[str] | None, name: str, step: int) -> int:
    """The drive whose folder holds ``step``'s ``state.pt`` (0 off a volume; -1: not found)."""
    for d, top in enumerate(paths or ["."]):
        if paths is None or os.path.exists(os.path.join(top, name, _step(step), "state.pt")):
            return d
    return -1


def run_single(
    loop: Any, folder: str, paths: list[str], drop_cache: Any, *, reps: int, steps: int, warmup: int, timed: int
) -> dict[str, Any]:
    """One process: ``CheckpointManager(keep=2, staging="snapshot")`` on ``folder`` (a folder on
    drive 0) against the same on ``Volume(paths)``, configurations interleaved (order alternated
    each repetition). Per repetition and configuration: ``warmup + steps`` training steps saving
    every step (step time and time blocked in ``save()``), ``timed`` saves each followed by
    ``wait()`` (seconds until committed, and the drive each step's file went to), the bytes per
    drive of the steps kept, then a cold restore of the newest step (``drop_cache`` first)."""
    import statistics
    import time

    import deepnvme

    configs = {"one": None, "volume": paths}
    runs: dict[str, dict[str, list[Any]]] = {
        k: {"step_s": [], "blocked_s": [], "save_s": [], "drives": [], "bytes_per_drive": [], "restore_s": []}
        for k in configs
    }
    for rep in range(reps):
        for kind in list(configs) if rep % 2 == 0 else list(reversed(configs)):
            where, name = configs[kind], f"mgr-{kind}"
            remove_target(where, folder, name)
            target = manager_target(where, folder, name)
            r = runs[kind]
            step = 0
            with deepnvme.CheckpointManager(target, keep=2, rng=False, staging="snapshot") as mgr:
                for i in range(warmup + steps):
                    t0 = time.perf_counter()
                    loop.step()
                    t1 = time.perf_counter()
                    mgr.save(step := step + 1, {"model": loop.model, "opt": loop.opt})
                    if i >= warmup:
                        r["step_s"].append(time.perf_counter() - t0)
                        r["blocked_s"].append(time.perf_counter() - t1)
                mgr.wait()
                for _ in range(timed):
                    t0 = time.perf_counter()
                    mgr.save(step := step + 1, {"model": loop.model, "opt": loop.opt})
                    mgr.wait()
                    r["save_s"].append(time.perf_counter() - t0)
                    r["drives"].append(_drive_of(where, name, step))
            kept = [step_files(where, folder, name, _step(s))[2] for s in (step - 1, step)]  # keep=2
            r["bytes_per_drive"].append([a + b for a, b in zip(*kept)])
            drop_cache([os.path.join(top, name) for top in (where or [folder])])
            reader = deepnvme.CheckpointManager(target, rng=False)
            try:
                t0 = time.perf_counter()
                reader.restore({"model": loop.model, "opt": loop.opt})
                r["restore_s"].append(time.perf_counter() - t0)
            finally:
                reader.close()
            remove_target(where, folder, name)
    med = statistics.median
    out: dict[str, Any] = {"runs": runs}
    for kind, r in runs.items():
        out[kind] = {k: med(r[k]) for k in ("step_s", "blocked_s", "save_s", "restore_s")}
        out[kind]["bytes_per_drive_kept"] = r["bytes_per_drive"][-1]
        out[kind]["drives_of_timed_saves"] = r["drives"]
    for kind in configs:
        c = out[kind]
        print(
            f"{kind:7s} step {c['step_s']:.3f} s  blocked {c['blocked_s']:.4f} s  save until committed "
            f"{c['save_s']:.3f} s  cold restore {c['restore_s']:.3f} s  drives of the timed saves "
            f"{c['drives_of_timed_saves']}  bytes per drive (2 kept steps) "
            f"{[round(b / 1e6) for b in c['bytes_per_drive_kept']]} MB"
        )
    out["ratios"] = {
        "save_speedup": out["one"]["save_s"] / out["volume"]["save_s"],
        "restore_speedup": out["one"]["restore_s"] / out["volume"]["restore_s"],
        "blocked_ratio": out["volume"]["blocked_s"] / out["one"]["blocked_s"],
        "step_ratio": out["volume"]["step_s"] / out["one"]["step_s"],
    }
    print("volume vs one drive: " + ", ".join(f"{k} {v:.3f}" for k, v in out["ratios"].items()))
    return out
