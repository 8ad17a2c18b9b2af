"""Timed single transfers for ``deepnvme bench``/``tune``: deepnvme, plain Python file I/O and fio.

Every tool measures the same thing the same way, so their numbers can be compared:

* a **write** goes to a file that does not exist yet (it is unlinked, untimed, before each
  write) and is timed until ``fsync`` returns, i.e. until the data reached stable storage;
* a **read** reads the whole file after its pages were dropped from the page cache (``fsync``
  then ``posix_fadvise(DONTNEED)``, untimed), so it is cold whether or not O_DIRECT is used.

deepnvme uses an :class:`~deepnvme.AioHandle` (O_DIRECT where the filesystem allows it),
plain Python uses ``open(..., buffering=0)`` with ``readinto``/``write`` loops (page cache),
fio uses ``--ioengine=libaio --direct=1`` with the same block size and queue depth and its
own reported runtime (which includes ``end_fsync`` for writes). Times are seconds from
``time.perf_counter`` (CLOCK_MONOTONIC, comparable across processes on one machine).

Random reads (``random=RandomReads(...)``): a read reads every ``size``-byte block of the file
once, in a new random order each time, each block one read (:meth:`AioHandle.read_many`
with the handle's queue depth); fio runs ``--rw=randread`` over the same file with the same
block size and reads in flight. Each block lands at its own offset of the buffer, so
validation compares the whole buffer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..config import IOConfig
from ..errors import DeepNVMeError, DeepNVMeIOError, ValidationError
from ..handles.aio import AioHandle
from ..io.posix import evict_page_cache as evict
from ..memory.views import byte_view
from ._engines import in_flight

__all__ = ["TOOLS", "Timing", "evict", "remove", "fio_path", "fio_command", "parse_fio_json",
           "parse_fio_latency", "RandomReads", "Measurer", "fill_pattern", "check_file",
           "probe_direct"]

TOOLS = ("deepnvme", "python", "fio")
_CHECK_BLOCK = 8 << 20


@dataclasses.dataclass(frozen=True)
class Timing:
    """One timed transfer: ``start``/``end`` on the perf_counter clock, ``seconds`` its duration."""

    start: float
    end: float
    seconds: float
    latency: float | None = None  # random reads: mean seconds one read is in flight


class RandomReads:
    """The requests of one random-read pass over ``buf``: every ``size``-byte block once.

    ``buf`` (CPU, uint8, a multiple of ``size`` long) must outlive this object; :meth:`items`
    gives ``(view, offset)`` pairs in a new order per call (views are made once, here, since
    making a view costs microseconds).
    """

    def __init__(self, buf: torch.Tensor, size: int, *, seed: int = 0) -> None:
        if size < 1 or buf.numel() % size:
            raise ValueError(f"a buffer of {buf.numel()} bytes is not a multiple of {size}")
        self.size = size
        self.count = buf.numel() // size
        self._views = buf.view(self.count, size).unbind(0)
        self._order = list(range(self.count))
        self._rng = random.Random(seed)

    def items(self) -> list[tuple[torch.Tensor, int]]:
        self._rng.shuffle(self._order)
        return [(self._views[i], i * self.size) for i in self._order]


def remove(path: str) -> None:
    """Unlink ``path`` if it exists (idempotent; used for cleanup and before each write)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def probe_direct(path: str) -> bool:
    """Whether the filesystem holding ``path`` (an existing file) accepts O_DIRECT reads."""
    from ..io.posix import POSIX

    try:
        fd = POSIX.open(path, write=False, direct=True)
    except OSError:
        return False
    try:
        POSIX.dio_alignment(fd)
        return True
    except OSError:
        return False
    finally:
        POSIX.close(fd)


def fill_pattern(buf: torch.Tensor, seed: int) -> None:
    """Fill a uint8 tensor with a cheap, seed-dependent, non-constant pattern (random 4 MiB tiles)."""
    n = buf.numel()
    gen = torch.Generator().manual_seed(seed)
    tile = torch.randint(0, 256, (min(n, 4 << 20),), dtype=torch.uint8, generator=gen)
    for start in range(0, n, tile.numel()):
        m = min(tile.numel(), n - start)
        buf[start:start + m].copy_(tile[:m])


def check_file(path: str, expected: torch.Tensor) -> None:
    """Compare the file's bytes with ``expected`` (buffered reads, untimed); raise on a mismatch."""
    mv = byte_view(expected)
    with open(path, "rb", buffering=0) as f:
        for start in range(0, len(mv), _CHECK_BLOCK):
            n = min(_CHECK_BLOCK, len(mv) - start)
            got = f.read(n)
            if got != mv[start:start + n]:
                raise ValidationError("validation failed: file bytes differ from what was written",
                                      path=path, offset=start, size=n)


def fio_path() -> str | None:
    """The fio executable on PATH, or None."""
    return shutil.which("fio")


def fio_command(fio: str, *, path: str, write: bool, io_size: int, block_size: int,
                queue_depth: int, random_order: bool = False) -> list[str]:
    """fio arguments for one sequential transfer of ``io_size`` bytes of ``path`` (JSON output);
    ``random_order``: read every ``block_size`` block once in random order (randread)."""
    rw = "randread" if random_order else "write" if write else "read"
    cmd = [fio, "--name=deepnvme-bench", "--filename=" + path.replace(":", "\\:"),
           "--rw=" + rw, f"--bs={block_size}",
           f"--iodepth={queue_depth}", "--ioengine=libaio", "--direct=1", f"--size={io_size}",
           "--numjobs=1", "--output-format=json"]
    if random_order:
        cmd.append("--randrepeat=0")  # a new order each run, as deepnvme's
    if write:
        cmd += ["--end_fsync=1", "--fallocate=none"]
    return cmd


def _fio_side(text: str, write: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(job, its read or write section) from fio's JSON output (which may follow notices)."""
    try:
        job = json.loads(text[text.index("{"):])["jobs"][0]
        return job, job["write" if write else "read"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise DeepNVMeError(f"could not parse fio's JSON output ({exc}): {text[:300]!r}") from None


def parse_fio_json(text: str, *, write: bool, io_size: int) -> float:
    """Seconds of the transfer from fio's JSON (its runtime, whole milliseconds, at least 1 ms)."""
    job, side = _fio_side(text, write)
    try:
        moved, runtime_ms = int(side["io_bytes"]), int(side["runtime"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DeepNVMeError(f"could not parse fio's JSON output ({exc}): {text[:300]!r}") from None
    if job.get("error"):
        raise DeepNVMeError(f"fio reported error {job['error']} for this job")
    if moved != io_size:
        raise DeepNVMeError(f"fio moved {moved} bytes instead of {io_size}")
    return max(runtime_ms, 1) / 1000.0


def parse_fio_latency(text: str, *, write: bool) -> float:
    """Mean seconds from submitting a request to its completion (fio's ``lat_ns`` mean)."""
    _, side = _fio_side(text, write)
    try:
        return float(side["lat_ns"]["mean"]) / 1e9
    except (KeyError, TypeError, ValueError) as exc:
        raise DeepNVMeError(f"fio's JSON has no latency ({exc}): {text[:300]!r}") from None


class _Reported(NamedTuple):
    """What a tool reports about its own transfer (fio), instead of the wall-clock time."""

    seconds: float
    latency: float | None = None


class Measurer:
    """Times write/read transfers of one buffer to one file with each tool (not thread-safe).

    ``buf`` is a CPU uint8 tensor of the transfer size that stays alive as long as this object;
    ``device_buf`` (optional) is a CUDA tensor: deepnvme moves it itself (pinned staging
    pipeline, or cuFile when ``gds``); plain Python copies it through ``buf`` in the timed region.
    ``random`` (views of ``buf``) turns reads into random reads (see the module docstring).
    ``scrub`` zeroes the buffers (untimed) before deepnvme and Python read into them, so that
    validating a read checks bytes it really moved. A ``config.engine`` the handle does not
    run raises :class:`DeepNVMeError`.
    """

    def __init__(self, *, path: str, buf: torch.Tensor, config: IOConfig,
                 device_buf: torch.Tensor | None = None, gds: bool = False,
                 random: RandomReads | None = None, scrub: bool = False) -> None:
        self.path = path
        self.buf = buf
        self.config = config
        self.device_buf = device_buf
        self.random = random
        self.scrub = scrub
        self._items: list[tuple[torch.Tensor, int]] = []
        if gds:
            from ..handles.gds import GdsHandle

            self.handle: AioHandle = GdsHandle(config=config)
        else:
            self.handle = AioHandle(config=config)
        if config.engine != "auto" and self.handle.engine != config.engine:
            self.handle.close()  # a measurement never falls back to another engine silently
            raise DeepNVMeError(f"asked for engine {config.engine!r}, the handle runs "
                                f"{self.handle.engine!r}")
        self._fio = fio_path()
        self._ops: dict[tuple[str, bool], Callable[[], _Reported | None]] = {
            ("deepnvme", True): self._deepnvme_write, ("deepnvme", False): self._deepnvme_read,
            ("python", True): self._python_write, ("python", False): self._python_read,
            ("fio", True): lambda: self._fio_run(True), ("fio", False): lambda: self._fio_run(False),
        }

    def close(self) -> None:
        self.handle.close()

    def prepare(self, tool: str, write: bool) -> None:
        """Untimed set-up before a measurement: unlink before a write, evict before a read
        (and scrub the buffers, and draw a new random order, where they apply)."""
        if write:
            remove(self.path)
            return
        evict(self.path)
        if self.scrub and tool != "fio":  # fio reads into its own memory
            for b in (self.buf, self.device_buf):
                if b is not None:
                    b.zero_()
        if self.random is not None and tool == "deepnvme":
            self._items = self.random.items()

    def measure(self, tool: str, *, write: bool) -> Timing:
        """Run one timed transfer with ``tool`` ("deepnvme", "python" or "fio")."""
        self.prepare(tool, write)
        t0 = time.perf_counter()
        reported = self._ops[(tool, write)]()
        t1 = time.perf_counter()
        if reported is not None:
            return Timing(t0, t1, reported.seconds, reported.latency)
        latency = None
        if self.random is not None and not write:  # Little's law: reads in flight / reads per s
            count = self.random.count
            latency = (t1 - t0) * min(in_flight(self.config, self.handle.engine), count) / count
        return Timing(t0, t1, t1 - t0, latency)

    # --- plain Python with --gpu: the device copy is part of the timed transfer ---------

    def _stage_out(self) -> None:
        if self.device_buf is not None:
            self.buf.copy_(self.device_buf)

    def _stage_in(self) -> None:
        if self.device_buf is not None:
            self.device_buf.copy_(self.buf, non_blocking=True)
            torch.cuda.synchronize(self.device_buf.device)

    # --- the tools ----------------------------------------------------------------------

    def _deepnvme_write(self) -> None:
        source = self.device_buf if self.device_buf is not None else self.buf
        self.handle.submit_write(source, self.path, fsync=True).result()

    def _deepnvme_read(self) -> None:
        if self.random is not None:
            want = self.buf.numel()
            got = self.handle.read_many(self.path, self._items).result()
            if got != want:
                raise DeepNVMeIOError(f"read_many moved {got} of {want} bytes", path=self.path,
                                      offset=0, size=want)
            return
        # a CUDA tensor's future completes with the device data ready (see memory/staging.py)
        target = self.device_buf if self.device_buf is not None else self.buf
        self.handle.submit_read(target, self.path).result()

    def _python_write(self) -> None:
        self._stage_out()
        view = byte_view(self.buf)
        with open(self.path, "wb", buffering=0) as f:
            done = 0
            while done < len(view):
                n = f.write(view[done:])
                if not n:
                    raise DeepNVMeIOError("plain write made no progress", path=self.path,
                                          offset=done, size=len(view) - done)
                done += n
            os.fsync(f.fileno())

    def _python_read(self) -> None:
        view = byte_view(self.buf)
        with open(self.path, "rb", buffering=0) as f:
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise DeepNVMeIOError("plain read hit end of file", path=self.path,
                                          offset=done, size=len(view) - done)
                done += n
        self._stage_in()

    def _fio_run(self, write: bool) -> _Reported:
        if self._fio is None:
            raise DeepNVMeError("fio is not installed (apt-get install fio)")
        c, size = self.config, self.buf.numel()
        r = None if write else self.random  # random reads: the kernel engines' reads in flight
        cmd = fio_command(self._fio, path=self.path, write=write, io_size=size,
                          block_size=r.size if r else c.block_size,
                          queue_depth=c.queue_depth * (c.intra_op_parallelism if r else 1),
                          random_order=r is not None)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise DeepNVMeError(f"fio failed (exit {proc.returncode}): {proc.stderr.strip()[:500]}")
        seconds = parse_fio_json(proc.stdout, write=write, io_size=size)
        return _Reported(seconds, parse_fio_latency(proc.stdout, write=write) if r else None)
