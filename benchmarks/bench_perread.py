"""CPU per small read (or, with ``--write``, small write) of the engine, A/B between source
trees in one run.

Shuffled reads of ``--size`` bytes (O_DIRECT, aligned) through ``AioHandle.read_many_into``,
one worker, ``--depth`` in flight. Each repetition runs in a fresh process with PYTHONPATH set
to one of the ``--src`` trees, the trees interleaved; each process reports the CPU seconds
(getrusage, user + sys, the whole process: the submitting and the I/O threads) and the wall
time of the reads only. The buffer is touched first, as a loader's reused buffers are. ``--fio`` adds fio (the same
reads: randread, O_DIRECT, one job, the same depth, ``--fio-engine``) as a reference, its CPU
from its own usr/sys figures. ``--write``: the same ranges written over the existing file with
``AioHandle.write_many`` (one (tensor, offset) item each, as callers give them), fio randwrite
beside. fio's defaults take one completion per ``io_getevents`` and resubmit it at once (its
``iodepth_batch_complete_max`` defaults to the minimum, 1). ``--fio-batch N`` also runs fio
reaping every completion that is ready (``iodepth_batch_complete_max=--depth``) and submitting
N reads per system call (``iodepth_batch_submit=N``; 32 is what deepnvme's small reads do: every
free slot at once); N = 1 reaps all but submits one per call. Repeat it for several variants:
controls that tell a device which rewards one-in-one-out from a cost of deepnvme's own.
Prints medians and the ratio of each tree to the first; writes JSON.

  python benchmarks/bench_perread.py FILE --src A=/work/main/src --src B=src --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, os, resource, sys, time
import torch
from deepnvme import AioHandle
path, engine, write = sys.argv[1], sys.argv[5], sys.argv[7] == "1"
size, count, depth, seed = (int(sys.argv[i]) for i in (2, 3, 4, 6))
blocks = os.path.getsize(path) // size
g = torch.Generator().manual_seed(seed)
offs = torch.randperm(blocks, generator=g)[:count].to(torch.int64) * size
sizes = torch.full((count,), size, dtype=torch.int64)
at = torch.arange(count, dtype=torch.int64) * size
buf = torch.empty(count * size + 4096, dtype=torch.uint8)
shift = (-buf.data_ptr()) % 4096
buf = buf[shift:shift + count * size]
buf.fill_(1)  # touched: time the reads, not the first faults of new memory
h = AioHandle(queue_depth=depth, intra_op_parallelism=1, engine=engine)
h.read_many_into(path, buf, buffer_offsets=at[:64], file_offsets=offs[:64], sizes=sizes[:64]).result()
items = [(buf[i * size:(i + 1) * size], o) for i, o in enumerate(offs.tolist())] if write else None
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, t0 = cpu(), time.perf_counter()
if write:
    n = h.write_many(path, items, fsync=False).result()
else:
    n = h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes).result()
t1, c1 = time.perf_counter(), cpu()
assert n == count * size, n
h.close()
print(json.dumps({"seconds": t1 - t0, "cpu_seconds": c1 - c0, "reads": count}))
"""


def _fio(a: argparse.Namespace, rep: int, batch: int = 0) -> dict[str, float]:
    extra = [f"--iodepth_batch_submit={batch}", "--iodepth_batch_complete_min=1",
             f"--iodepth_batch_complete_max={a.depth}"] if batch else []
    out = subprocess.run(["fio", "--name=perread", f"--filename={a.file}", *extra,
                          f"--rw={'randwrite' if a.write else 'randread'}",
                          f"--bs={a.size}", f"--iodepth={a.depth}", f"--ioengine={a.fio_engine}",
                          "--direct=1", f"--number_ios={a.count}", f"--randseed={rep + 1}",
                          "--norandommap", "--output-format=json"],
                         check=True, capture_output=True, text=True, timeout=600).stdout
    job = json.loads(out)["jobs"][0]
    side = job["write" if a.write else "read"]
    seconds = side["runtime"] / 1000
    reads = side["total_ios"]
    return {"seconds": seconds, "cpu_seconds": (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds,
            "reads": reads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    p.add_argument("--src", action="append", required=True, help="NAME=PATH of a source tree")
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--count", type=int, default=65536)
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--engine", default="auto")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--fio", action="store_true")
    p.add_argument("--write", action="store_true", help="small writes over the file instead")
    p.add_argument("--fio-engine", default="io_uring")
    p.add_argument("--fio-batch", type=int, action="append", default=[],
                   help="also run fio reaping every ready completion and submitting this many "
                        "reads per system call (repeatable)")
    p.add_argument("--out")
    a = p.parse_args()
    trees = [s.split("=", 1) for s in a.src]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    if a.fio:
        runs["fio"] = []
    for batch in a.fio_batch:
        runs[f"fio-batch{batch}"] = []
    for rep in range(a.reps):
        if a.fio:
            runs["fio"].append(_fio(a, rep))
        for batch in a.fio_batch:
            runs[f"fio-batch{batch}"].append(_fio(a, rep, batch))
        for name, src in trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
            out = subprocess.run([sys.executable, "-c", _CHILD, a.file, str(a.size), str(a.count),
                                  str(a.depth), a.engine, str(rep), str(int(a.write))], env=env, check=True,
                                 capture_output=True, text=True, timeout=600).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    summary = {}
    for name, rs in runs.items():
        us = statistics.median(r["cpu_seconds"] / r["reads"] * 1e6 for r in rs)
        iops = statistics.median(r["reads"] / r["seconds"] for r in rs)
        summary[name] = {"cpu_us_per_read": us, "iops": iops,
                         "cpu_us_per_read_all": [r["cpu_seconds"] / r["reads"] * 1e6 for r in rs],
                         "iops_all": [r["reads"] / r["seconds"] for r in rs]}
        print(f"{name:>10}: {us:6.2f} CPU-us/read  {iops:9.0f} IOPS (medians of {len(rs)})")
    first = trees[0][0]
    for name, _ in trees[1:]:
        cpu = summary[name]["cpu_us_per_read"] / summary[first]["cpu_us_per_read"]
        print(f"{name} / {first}: CPU per read {cpu:.2f}x, "
              f"IOPS {summary[name]['iops'] / summary[first]['iops']:.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"workload": vars(a), "trees": dict(trees), "results": summary}, f, indent=1)


if __name__ == "__main__":
    main()
