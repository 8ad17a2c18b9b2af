"""The tables of benchmarks/bench_engines.py: medians, the markdown rows and the ratios."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench_engines_worker import RAND_BLOCK

RAND_QUEUE_DEPTH = 32
FIO_SEQ = "fio libaio 1 job"
FIO_RAND = "fio libaio"
SEQ_OPS = ("write_new", "write", "read")
SEQ_NAMES = {"write_new": "new-file write", "write": "write", "read": "read"}
Samples = dict[str, dict[str, list[dict[str, Any]]]]   # label -> op -> samples
Medians = dict[str, dict[str, dict[str, float]]]       # label -> op -> summary

def rate(s: dict[str, Any], op: str) -> float:
    return s["bytes"] / s["seconds"] / (RAND_BLOCK if op == "randread" else 1e9)


def cpu_per_gb(s: dict[str, Any]) -> float:
    return (s["cpu_user"] + s["cpu_sys"]) / (s["bytes"] / 1e9)


def summary(samples: list[dict[str, Any]], op: str) -> dict[str, float]:
    rates = [rate(s, op) for s in samples]
    cpus = [cpu_per_gb(s) for s in samples]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates),
            "cpu_per_gb": statistics.median(cpus), "cpu_min": min(cpus), "cpu_max": max(cpus),
            "cpu_us_per_io": statistics.median((s["cpu_user"] + s["cpu_sys"]) * 1e6 / (s["bytes"] / RAND_BLOCK)
                                               for s in samples)}


def cell(m: dict[str, float], key: str = "median", lo: str = "min", hi: str = "max", fmt: str = ".2f") -> str:
    return f"{m[key]:{fmt}} [{m[lo]:{fmt}}-{m[hi]:{fmt}}]"


def report(args: argparse.Namespace, machine: dict[str, str], notes: list[str], results: Samples) -> Medians:
    med = {label: {op: summary(s, op) for op, s in ops.items()} for label, ops in results.items()}
    for key, value in machine.items():
        print(f"{key:9s} {value}")
    size = f"{args.size / 2**30:g} GiB" if args.size >= 1 << 30 else f"{args.size / 2**20:g} MiB"
    print(f"\nsequential: {size} per op, block {args.block_size >> 10} KiB, queue depth "
          f"{args.queue_depth} (fio: one job), {args.reps} rounds; median GB/s [min-max]; CPU s/GB = "
          "user+sys CPU seconds of the process doing the I/O per GB moved; GB = 1e9 B"
          + (f"; buffer reused: {args.reuse} timed transfers per process after a warm-up"
             if getattr(args, "reuse", 0) else "") + "\n")
    seq_ops = [op for op in SEQ_OPS if any(op in ops for ops in med.values())]
    print("| tool | " + " | ".join(f"{SEQ_NAMES[op]} GB/s" for op in seq_ops) + " | "
          + " | ".join(f"{SEQ_NAMES[op]} CPU s/GB" for op in seq_ops) + " |")
    print("|---" * (1 + 2 * len(seq_ops)) + "|")
    for label, ops in med.items():
        if "write" in ops:
            have = [ops[op] for op in seq_ops]
            print(f"| {label} | " + " | ".join(cell(m) for m in have) + " | "
                  + " | ".join(cell(m, 'cpu_per_gb', 'cpu_min', 'cpu_max', '.3f') for m in have) + " |")
    rand = {label: ops["randread"] for label, ops in med.items() if "randread" in ops}
    if rand:
        print(f"\nrandom reads: {args.rand_ios} x 4 KiB at random 4 KiB-aligned offsets of the file, "
              f"O_DIRECT, queue depth {RAND_QUEUE_DEPTH}, 1 worker (fio: one job); median IOPS "
              "[min-max]; CPU us/IO = user+sys CPU microseconds per read\n")
        print("| tool | IOPS | CPU us/IO |")
        print("|---|---|---|")
        for label, m in rand.items():
            print(f"| {label} | {cell(m, fmt=',.0f')} | {m['cpu_us_per_io']:.1f} |")
    if notes:
        print("\nnotes:\n" + "\n".join(f"- {n}" for n in notes))
    print_ratios(med)
    return med


def print_ratios(med: Medians) -> None:
    """deepnvme / DeepSpeed at the same parallelism and deepnvme / fio, as the last lines."""
    seq: list[str] = []
    rand: list[str] = []
    fio = med.get(FIO_SEQ)
    seq_ops = [op for op in SEQ_OPS if all(op in ops for ops in med.values() if "write" in ops)]
    for label, ops in med.items():
        if not label.startswith("deepnvme"):
            continue
        name = label.removeprefix("deepnvme ")
        if "write" in ops:
            p = label.rsplit(" ", 1)[1]
            for peer_name, peer in ((f"DeepSpeed {p}", med.get(f"DeepSpeed aio {p}")), ("fio", fio)):
                if peer:
                    have = [op for op in seq_ops if op in ops and op in peer]
                    seq.append(f"| {name} / {peer_name} | "
                               + " | ".join(f"{ops[op]['median'] / peer[op]['median']:.2f}" for op in have)
                               + " | " + " | ".join(_cpu_ratio(ops[op], peer[op]) for op in have) + " |")
        if "randread" in ops:
            for peer_label in ("DeepSpeed aio", FIO_RAND):
                rpeer = med.get(peer_label, {}).get("randread")
                if rpeer:
                    rand.append(f"| {name} / {peer_label.split()[0]} "
                                f"| {ops['randread']['median'] / rpeer['median']:.2f} "
                                f"| {_cpu_ratio(ops['randread'], rpeer)} |")
    if seq or rand:
        print("\nratios of medians, deepnvme / peer (GB/s and IOPS: above 1 = deepnvme faster; "
              "CPU: below 1 = deepnvme spends less per byte)")
    if seq:
        print("\n| sequential, deepnvme / peer | "
              + " | ".join(f"{SEQ_NAMES[op]} GB/s" for op in seq_ops) + " | "
              + " | ".join(f"{SEQ_NAMES[op]} CPU/GB" for op in seq_ops) + " |")
        print("|---" * (1 + 2 * len(seq_ops)) + "|")
        print("\n".join(seq))
    if rand:
        print("\n| random 4 KiB, deepnvme / peer | IOPS | CPU/IO |")
        print("|---|---|---|")
        print("\n".join(rand))


def _cpu_ratio(mine: dict[str, float], peer: dict[str, float]) -> str:
    return f"{mine['cpu_per_gb'] / peer['cpu_per_gb']:.2f}" if peer["cpu_per_gb"] > 0 else "-"
