"""One measurement of benchmarks/bench_engines.py, in a fresh process.

Usage: python benchmarks/bench_engines_worker.py SPEC_JSON   (run by bench_engines.py, not by hand)

Prints one line, RESULT_TAG + JSON: {seconds, bytes, cpu_user, cpu_sys, engine} for a "write",
"write_new", "read" or "randread" op; what the tool offers for a "probe". Imports only the standard library,
torch and the tool measured: DeepSpeed's interpreter (a side venv) has no deepnvme. Allocating
and filling the buffer happen before the timed region; CPU is getrusage(RUSAGE_SELF) of this
process (every thread, the tool's native threads included) around it.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

RESULT_TAG = "BENCH_ENGINES_RESULT "
RAND_BLOCK = 4096
DS_RAND_BATCH = 512  # DeepSpeed random reads per wait() (see DeepSpeedTool.read_at)


class DeepnvmeTool:
    """deepnvme.AioHandle; ``engine`` None = the handle's default (before it took engine=)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import deepnvme

        self.deepnvme = deepnvme
        self.has_engine_param = "engine" in inspect.signature(deepnvme.AioHandle).parameters
        kwargs: dict[str, Any] = {"block_size": spec["block_size"], "queue_depth": spec["queue_depth"],
                                  "intra_op_parallelism": spec["parallelism"]}
        engine = spec.get("engine")
        if engine is not None and self.has_engine_param:
            kwargs["engine"] = engine
        elif engine not in (None, "threads"):
            raise RuntimeError(f"this deepnvme.AioHandle takes no engine=, so cannot run {engine!r}")
        self.handle = deepnvme.AioHandle(**kwargs)
        self.engine = str(getattr(self.handle, "engine", "threads"))

    def offers(self) -> dict[str, Any]:
        import torch
        return {"version": str(getattr(self.deepnvme, "__version__", "?")), "torch": torch.__version__,
                "engine_param": self.has_engine_param,
                "read_many": hasattr(self.handle, "read_many")}

    def alloc(self, nbytes: int) -> Any:
        import torch
        return self.deepnvme.new_cpu_locked_tensor(nbytes, torch.uint8)

    def write(self, buf: Any, path: str) -> int:
        return int(self.handle.submit_write(buf, path, fsync=True).result())

    def read(self, buf: Any, path: str) -> int:
        return int(self.handle.submit_read(buf, path).result())

    def read_at(self, items: list[tuple[Any, int]], path: str) -> int:
        read_many = getattr(self.handle, "read_many", None)
        if read_many is not None:
            return int(read_many(path, items).result())
        # before read_many: one request per 4 KiB read, all submitted, then awaited
        futures = [self.handle.submit_read(t, path, offset=off) for t, off in items]
        return sum(int(f.result()) for f in futures)

    def close(self) -> None:
        self.handle.close()


class DeepSpeedTool:
    """DeepSpeed's aio_handle (libaio), JIT-loaded through AsyncIOBuilder."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        aio = AsyncIOBuilder().load(verbose=False)
        self.handle = aio.aio_handle(block_size=spec["block_size"], queue_depth=spec["queue_depth"],
                                     single_submit=False, overlap_events=True,
                                     intra_op_parallelism=spec["parallelism"])
        self.engine = "libaio"
        self.buffers: list[Any] = []

    def offers(self) -> dict[str, Any]:
        import deepspeed
        import torch
        return {"version": str(deepspeed.__version__), "torch": torch.__version__}

    def alloc(self, nbytes: int) -> Any:
        import torch
        buf = self.handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
        self.buffers.append(buf)
        return buf

    def write(self, buf: Any, path: str) -> int:
        """sync_pwrite, then fsync through a descriptor of our own: both are timed."""
        status = self.handle.sync_pwrite(buf, path)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return _moved(status, buf.numel(), "sync_pwrite")

    def read(self, buf: Any, path: str) -> int:
        return _moved(self.handle.sync_pread(buf, path), buf.numel(), "sync_pread")

    def read_at(self, items: list[tuple[Any, int]], path: str) -> int:
        """One async_pread per item, wait() after every DS_RAND_BATCH of them: each
        async_pread opens the file and keeps it open until wait(), so 65,536 at once run out of
        file descriptors (async_pread then fails, and the handle aborts on exit)."""
        for start in range(0, len(items), DS_RAND_BATCH):
            part = items[start:start + DS_RAND_BATCH]
            for t, off in part:
                if self.handle.async_pread(t, path, off) != 0:
                    raise RuntimeError("aio_handle.async_pread refused a read")
            done = self.handle.wait()
            if done != len(part):
                raise RuntimeError(f"aio_handle.wait() reported {done} of {len(part)} reads")
        return sum(t.numel() for t, _ in items)

    def close(self) -> None:
        for buf in self.buffers:
            self.handle.free_cpu_locked_tensor(buf)


def _moved(status: int, nbytes: int, what: str) -> int:
    if status < 0:
        raise RuntimeError(f"aio_handle.{what} returned {status}")
    return nbytes


def fill(buf: Any) -> None:
    """Random bytes (one random MiB, repeated), so no layer can skip or compress zero pages."""
    import torch
    n = buf.numel()
    block = torch.randint(0, 256, (min(n, 1 << 20),), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(12))
    whole = n // block.numel() * block.numel()
    if whole:
        buf[:whole].view(-1, block.numel()).copy_(block)
    buf[whole:].copy_(block[: n - whole])


def random_offsets(file_size: int, count: int, seed: int) -> list[int]:
    """``count`` uniformly random offsets of whole 4 KiB blocks of the file (with repeats)."""
    rng = random.Random(seed)
    blocks = file_size // RAND_BLOCK
    return [rng.randrange(blocks) * RAND_BLOCK for _ in range(count)]


def timed(fn: Callable[[], int]) -> dict[str, float]:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    moved = fn()
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": t1 - t0, "cpu_user": r1.ru_utime - r0.ru_utime,
            "cpu_sys": r1.ru_stime - r0.ru_stime, "moved": moved}


def sequential(tool: Any, op: str, buf: Any, path: str, reuse: int) -> dict[str, float]:
    """One timed transfer of ``buf`` (``reuse`` 0: the process's first, as a one-off save or
    load pays it), or, with ``reuse`` N, one untimed warm-up transfer and then N timed ones of
    the same buffer, summed (as a training job's swap and staging buffers are reused): each
    read starts with the file's pages dropped, each new-file write with the file deleted."""
    write = op in ("write", "write_new")

    def once() -> int:
        return int(tool.write(buf, path) if write else tool.read(buf, path))

    if not reuse:
        return timed(once)
    once()
    total: dict[str, float] = {}
    for _ in range(reuse):
        if op == "write_new":
            os.unlink(path)
        elif not write:
            drop_cache(path)
        for key, value in timed(once).items():
            total[key] = total.get(key, 0) + value
    return total


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def probe(tool: Any, path: str) -> dict[str, Any]:
    """Write and read back 1 MiB through the tool: it loads and moves bytes on this filesystem."""
    src, dst = tool.alloc(1 << 20), tool.alloc(1 << 20)
    fill(src)
    dst.zero_()
    tool.write(src, path)
    tool.read(dst, path)
    if not bool((src == dst).all()):
        raise RuntimeError("the probe read back different bytes than it wrote")
    return {"engine": tool.engine, **tool.offers()}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    tool = DeepSpeedTool(spec) if spec["tool"] == "deepspeed" else DeepnvmeTool(spec)
    try:
        op, path = spec["op"], spec["path"]
        if op == "probe":
            return probe(tool, path)
        if op == "randread":
            buf = tool.alloc(spec["ios"] * RAND_BLOCK)
            buf.zero_()
            items = [(buf[i * RAND_BLOCK:(i + 1) * RAND_BLOCK], off)
                     for i, off in enumerate(random_offsets(spec["file_size"], spec["ios"], spec["seed"]))]
            result = timed(lambda: tool.read_at(items, path))
        else:
            buf = tool.alloc(spec["size"])
            if op in ("write", "write_new"):
                fill(buf)
            else:
                buf.zero_()
            result = sequential(tool, op, buf, path, spec.get("reuse", 0))
        expected = buf.numel() * max(1, spec.get("reuse", 0))
        if result.pop("moved") != expected:
            raise RuntimeError(f"{op} moved a different byte count than the {expected} asked")
        return {**result, "bytes": expected, "engine": tool.engine}
    finally:
        tool.close()


if __name__ == "__main__":
    print(RESULT_TAG + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
