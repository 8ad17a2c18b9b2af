"""Whole-file load timings for ``deepnvme tune --load`` (:func:`measure_dir`): each load runs in
a fresh process, ``python -m deepnvme.checkpoint._load_probe FILE KIND COUNT NUMEL``.

FILE is a safetensors file of COUNT uint8 tensors ``t0``... of NUMEL bytes each; KIND is
``fresh_direct``, ``fresh_mapped``, ``into_direct`` or ``into_mapped``. A fresh load is
``deepnvme.load_safetensors`` on that path, timed until one byte of every page has been read
(what a caller pays on first use of the tensors); ``load_into`` fills tensors allocated and
touched before the clock starts. Prints ``{"kind": ..., "seconds": ..., "bytes": ...}`` as the
last line of standard output. A fresh process for each load, so that nothing of the previous
load (memory it faulted in and freed, the allocator's pools) speeds up or slows down the next,
as whole loads of a job would run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from ..config import IOConfig
from ..errors import DeepNVMeError
from ..io import durable
from ..io.posix import evict_page_cache
from ._load_path import KINDS, WHOLE_BYTES, LoadPaths, remeasure
from .inplace import load_into
from .safetensors import load_safetensors, save_safetensors

__all__ = ["measure_dir", "measure_whole", "run"]


def run(path: str, kind: str, count: int, numel: int) -> float:
    """Seconds of one ``kind`` load of ``path`` in this process (see the module)."""
    if kind not in KINDS:
        raise ValueError(f"load probe: unknown kind {kind!r}; one of {', '.join(KINDS)}")
    config = {"load_path": kind.split("_")[1]}
    target = {f"t{i}": torch.ones(numel, dtype=torch.uint8) for i in range(count)} if kind.startswith("into") else {}
    evict_page_cache(path)
    t0 = time.perf_counter()
    if target:
        load_into(target, path, config=config)
    else:
        loaded = load_safetensors(path, config=config)
        if len(loaded) != count:
            raise ValueError(f"load probe: {path!r} holds {len(loaded)} tensors, expected {count}")
        for tensor in loaded.values():
            int(tensor.reshape(-1).view(torch.uint8)[::4096].sum())  # the first access of every page
    return time.perf_counter() - t0


def measure_whole(path: str, count: int, numel: int, *, rounds: int = 3) -> dict[str, float]:
    """GB/s of each path (the keys of :func:`measure`) loading the whole safetensors file
    ``path`` (``count`` uint8 tensors ``t0``... of ``numel`` bytes) cold, each load in a fresh
    process (:mod:`._load_probe`), the order alternating per round; medians. Blocks (seconds per
    load); ``DeepNVMeError`` with the probe's error output if one fails."""
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(rounds):
        for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
            evict_page_cache(path)
            done = subprocess.run([sys.executable, "-m", "deepnvme.checkpoint._load_probe", path, kind,
                                   str(count), str(numel)], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise DeepNVMeError(f"load probe {kind} of {path!r} failed (exit status {done.returncode}): "
                                    f"{done.stderr.strip()[-800:]}")
            times[kind].append(float(json.loads(done.stdout.strip().splitlines()[-1])["seconds"]))
    return {k: count * numel / statistics.median(v) / 1e9 for k, v in times.items()}


def measure_dir(directory: str, cfg: IOConfig, *, size: int = WHOLE_BYTES, rounds: int = 3) -> LoadPaths:
    """Measure the load paths of ``directory``'s device on a new temporary safetensors file there
    (``size`` bytes of 16 MiB tensors, written durably, removed after): whole loads, each in a
    fresh process, ``rounds`` of each path (:func:`measure_whole`); cache the choice. Blocks."""
    numel = min(16 << 20, max(1 << 20, size // 4))
    count = max(1, size // numel)
    path = durable.create_temp(directory, "deepnvme-load-probe")
    try:
        gen = torch.Generator().manual_seed(0)
        tensors = {f"t{i}": torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=gen) for i in range(count)}
        save_safetensors(tensors, path, config=cfg)
        del tensors
        return remeasure(path, cfg, rates=measure_whole(path, count, numel, rounds=rounds))
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def main(argv: list[str]) -> int:
    path, kind, count, numel = argv[0], argv[1], int(argv[2]), int(argv[3])
    seconds = run(path, kind, count, numel)
    print(json.dumps({"kind": kind, "seconds": seconds, "bytes": count * numel}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
