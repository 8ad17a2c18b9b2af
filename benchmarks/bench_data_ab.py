"""A/B of the token-dataset reader between two source trees: CPU per sample and samples/s.

Usage (root, for drop_caches):
  python benchmarks/bench_data_ab.py PREFIX REPS OUT.json|- MAIN_SRC BRANCH_SRC

Each pass is a fresh process reading ``TokenDataset.batches`` (batches of 32, prefetch 16) of
PREFIX.bin/.idx cold (page cache dropped after a short warm-up of the handle), either 8,192
shuffled samples or 32,768 consecutive ones; the two trees alternate first and second every
repetition. CPU = getrusage(RUSAGE_SELF) user + system over the pass (every thread), per sample.
Medians; the checksums of a tree must agree between repetitions. A pass that printed its result
and then failed at interpreter exit (seen on 2026-12-07: ``terminate called without an active
exception``, SIGABRT, about 1 in 8 processes on both trees) is kept and reported as such.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

CHILD = r'''
import json, resource, sys, time
import torch
from deepnvme.data import TokenDataset
torch.set_num_threads(1)
ds = TokenDataset(sys.argv[1], seq_len=2048)
g = torch.Generator().manual_seed(0)
count = len(ds)
shuffled = torch.randperm(count, generator=g)[:8192].tolist()
start = int(torch.randint(0, count - 32768 + 1, (1,), generator=g))
order = shuffled if sys.argv[2] == "shuffled" else list(range(start, start + 32768))
for b in ds.batches(order[:256], 32, prefetch=16):  # the handle and its threads up
    pass
with open("/proc/sys/vm/drop_caches", "w") as f:
    f.write("3")
r0, t0, total = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), 0
for b in ds.batches(order, 32, prefetch=16):
    total += int(b.sum())
t, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
print(json.dumps({"sps": len(order) / t, "cpu_us": 1e6 * cpu / len(order),
                  "sys_us": 1e6 * (r1.ru_stime - r0.ru_stime) / len(order), "sum": total}))
'''
ORDERS = ("shuffled", "sequential")


def main() -> int:
    prefix, reps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    trees = {"main": sys.argv[4], "branch": sys.argv[5]}
    runs: dict[str, list[dict[str, float]]] = {f"{o} {t}": [] for o in ORDERS for t in trees}
    for rep in range(reps):
        for order in ORDERS:
            pairs = list(trees.items()) if rep % 2 == 0 else list(reversed(trees.items()))
            for tree, src in pairs:
                proc = subprocess.run([sys.executable, "-c", CHILD, prefix, order],
                                      env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"},
                                      capture_output=True, text=True)
                lines = proc.stdout.strip().splitlines()
                if proc.returncode and not (lines and lines[-1].startswith("{")):
                    raise RuntimeError(f"{order} {tree}: exit status {proc.returncode}\n{proc.stderr[-2000:]}")
                if proc.returncode:  # the pass finished and printed its result, then the exit failed
                    print(f"note: {order} {tree} exited with status {proc.returncode} after its result: "
                          f"{proc.stderr.strip().splitlines()[-1:]}", flush=True)
                runs[f"{order} {tree}"].append({**json.loads(lines[-1]), "exit_status": proc.returncode})
    summary = {}
    for key, got in runs.items():
        if len({r["sum"] for r in got}) != 1:
            raise RuntimeError(f"{key}: checksums differ between repetitions")
        cpu = [r["cpu_us"] for r in got]
        summary[key] = {"sps": statistics.median(r["sps"] for r in got), "cpu_us": statistics.median(cpu),
                        "sys_us": statistics.median(r["sys_us"] for r in got), "range_cpu_us": [min(cpu), max(cpu)]}
        s = summary[key]
        print(f"{key:22s} {s['sps']:>9,.0f} samples/s  CPU {s['cpu_us']:.1f} us/sample (sys {s['sys_us']:.1f}; "
              f"range {min(cpu):.1f}-{max(cpu):.1f})")
    for order in ORDERS:
        main_row, branch_row = summary[f"{order} main"], summary[f"{order} branch"]
        print(f"{order}: CPU per sample main/branch = {main_row['cpu_us'] / branch_row['cpu_us']:.2f}x; "
              f"samples/s branch/main = {branch_row['sps'] / main_row['sps']:.2f}x")
    if out != "-":
        with open(out, "w") as f:
            json.dump({"runs": runs, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
