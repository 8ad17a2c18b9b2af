"""Checks and set-up before ``deepnvme bench`` measures anything: options validated at the
boundary (errors say the fix), the tools and engines to run, the temporary files."""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError, DeepNVMeError
from ..io.durable import create_temp
from ._engines import engine_statuses, require_engines
from ._measure import fio_path
from ._storage_types import BenchOptions
from ._system import mem_available
from ._units import GB

__all__ = ["check_options", "pick_tools", "pick_engines", "make_paths", "RANDOM_SIZES"]

#: --random-size: multiples of 4 KiB from 4 KiB to 64 KiB
RANDOM_SIZES = range(4 << 10, (64 << 10) + 1, 4 << 10)


def check_options(o: BenchOptions) -> list[str]:
    """Validate ``o`` (raising ConfigError/DeepNVMeError with the fix); return notes for the report."""
    notes: list[str] = []
    for name, value, low in (("--io-size", o.io_size, 1), ("--loops", o.loops, 1),
                             ("--warmup-loops", o.warmup, 0), ("--procs", o.procs, 1)):
        if value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    if not (o.read or o.write):
        raise ConfigError("nothing to do: give --read, --write, or neither for both")
    if o.random_size is not None:
        _check_random(o, o.random_size)
    notes += _check_devices(o)
    _check_dirs(o)
    need = o.io_size * o.procs * (2 if o.validate else 1)
    avail = mem_available()
    if avail is not None and need > 0.8 * avail:
        raise ConfigError(f"{need / GB:.2f} GB of buffers (io size x procs"
                          f"{' x 2 for --validate' if o.validate else ''}) exceeds 80% of the "
                          f"{avail / GB:.2f} GB of available memory; lower --io-size or --procs")
    if o.sequential_requests:
        notes.append("--sequential-requests (overlap_events=False) is accepted for ds_io parity; "
                     "every engine overlaps submission and completion, so it changes nothing")
    return notes


def _check_random(o: BenchOptions, size: int) -> None:
    if size not in RANDOM_SIZES:
        raise ConfigError(f"--random-size must be a multiple of 4K from 4K to 64K, got {size}")
    if o.write:
        raise ConfigError("--random measures reads only: drop --write (BenchOptions: write=False)")
    if o.io_size % size:
        raise ConfigError(f"--io-size ({o.io_size}) must be a multiple of --random-size ({size}) "
                          "with --random: the file is read as whole blocks")
    if o.gpu or o.gds:
        raise ConfigError("--random reads into CPU buffers: drop --gpu/--gds")


def _check_devices(o: BenchOptions) -> list[str]:
    notes: list[str] = []
    if o.gds:
        from ..handles.gds import gds_status

        status = gds_status()
        if not status.available:
            raise DeepNVMeError(f"--gds: GPUDirect Storage is not available: {status.detail} "
                                "(run 'deepnvme report'); use --gpu to stage GPU buffers through "
                                "pinned host memory")
    if o.gpu or o.gds:
        if not torch.cuda.is_available():
            raise DeepNVMeError("--gpu needs a CUDA device, but torch.cuda.is_available() is False "
                                f"(torch {torch.__version__}); drop --gpu to measure CPU buffers")
        count = torch.cuda.device_count()
        bad = [g for g in o.gpus if g >= count]
        if bad:
            raise ConfigError(f"--dir-map names GPU {bad[0]} but only {count} CUDA device(s) exist")
    elif o.gpus:
        notes.append("--dir-map GPU ids are ignored without --gpu")
    if o.gds:
        notes.append("--gds: deepnvme moves the GPU buffers with GdsHandle (cuFile); plain "
                     "Python stages them through host memory")
    return notes


def _check_dirs(o: BenchOptions) -> None:
    for d in o.dirs:
        if not os.path.isdir(d):
            raise DeepNVMeError(f"directory {d!r} does not exist (or is not a directory); "
                                "pass an existing one with --dir")
    for d in dict.fromkeys(o.dirs):
        os.unlink(make_paths((d,), 1)[0])  # writable? (a clear error if not)
        files = sum(1 for i in range(o.procs) if o.dirs[i % len(o.dirs)] == d)
        free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
        if files * o.io_size > free:
            raise DeepNVMeError(f"{d!r} has {free / GB:.3f} GB free but the benchmark writes "
                                f"{files * o.io_size / GB:.3f} GB there; lower --io-size or "
                                "--procs, or pick another --dir")


def pick_engines(o: BenchOptions, notes: list[str]) -> tuple[str, ...]:
    """deepnvme's engines to sweep, ``auto`` resolved; an unavailable one is an error."""
    engines = require_engines(o.engines or (o.config.engine,), engine_statuses())
    if o.single_submit and "threads" in engines:
        notes.append("--single-submit has no effect with the threads engine (it batches "
                     "nothing); it applies to io_uring and aio")
    return engines


def pick_tools(o: BenchOptions, notes: list[str]) -> tuple[str, ...]:
    """deepnvme, and with ``compare`` plain Python (not for random reads) and fio where it runs."""
    if not o.compare:
        return ("deepnvme",)
    tools = ["deepnvme"] if o.random_size else ["deepnvme", "python"]
    if fio_path() is None:
        notes.append("fio is not installed, so it was not compared (apt-get install fio)")
    elif not o.random_size and (o.io_size % o.config.block_size or o.io_size % 4096):
        notes.append("fio was not compared: --io-size must be a multiple of --block-size and of "
                     "4096 for fio's O_DIRECT transfers")
    else:
        tools.append("fio")
    if o.gpu:
        notes.append("with --gpu, deepnvme and python include the device copy; fio measures "
                     "storage only")
    return tuple(tools)


def make_paths(dirs: tuple[str, ...], procs: int) -> list[str]:
    """One new empty temporary file per process (``dirs`` round-robin); all or none.

    Named like a save's temporary files (with this process's pid), so ``deepnvme clean`` and
    the next bench remove any that a killed run leaves.
    """
    paths: list[str] = []
    try:
        for i in range(procs):
            d = dirs[i % len(dirs)]
            try:
                path = create_temp(d, f"deepnvme-bench-{i}")
            except OSError as exc:
                raise DeepNVMeError(f"cannot create a file in {d!r} ({exc.strerror}); pass a "
                                    "writable directory with --dir") from None
            paths.append(path)
    except BaseException:
        for p in paths:
            os.unlink(p)
        raise
    return paths
