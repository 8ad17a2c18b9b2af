"""Training data from NVMe: token-dataset samples, deepnvme vs megatron-core and np.memmap (issue 18).

Usage:
  flock /tmp/bench.lock python benchmarks/bench_data.py --dir DIR [--size 3G] [--seq-len 2048]
         [--batch-size 32] [--shuffled 8192] [--sequential 32768] [--reps 3] [--json OUT] [--keep]
         [--evict auto|drop-caches|fadvise|none] [--readers deepnvme,megatron-core,np.memmap]

Writes a corpus of ``--size`` bytes of uint16 tokens (random tokens, documents of 1 to 16,384
tokens) with ``deepnvme.data.write_token_dataset`` under DIR (reused when it is already there
with the same size), then runs ``deepnvme bench data``'s measurement (deepnvme.bench.data):
a shuffled pass (``--shuffled`` distinct random samples of the whole corpus) and a sequential
pass (``--sequential`` consecutive samples from a random start), every reader in the same
repetition, ``sync; echo 3 > /proc/sys/vm/drop_caches`` before each pass (root; else fadvise),
each pass marked cold/warm by mincore. Readers: deepnvme ``TokenDataset.batches``; megatron-core
``IndexedDataset(mmap=True)`` read as its GPT dataset does (``get(doc, offset, length)`` per
document piece); ``np.memmap`` sliced per sample. Every reader builds the same int64 batches;
their checksums must agree. Medians over repetitions; the ratios against the targets last.
The corpus is removed afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from deepnvme.bench import DataBenchResult, DataOptions, run_data_bench
from deepnvme.cli._render import stdout_console
from deepnvme.cli.bench_data import render_data_bench
from deepnvme.config import parse_size
from deepnvme.data import write_token_dataset

TARGETS = {"shuffled": ("megatron-core", 2.0), "sequential": ("megatron-core", 1.0)}


def make_corpus(prefix: str, nbytes: int, *, seed: int = 0) -> None:
    """``nbytes`` of random uint16 tokens in documents of 1..16,384 tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = nbytes // 2

    def documents():  # type: ignore[no-untyped-def]
        left = tokens
        while left:
            n = min(left, int(torch.randint(1, 16385, (1,), generator=g)))
            left -= n
            yield torch.randint(0, 65535, (n,), generator=g, dtype=torch.int32)

    write_token_dataset(prefix, documents(), dtype=torch.uint16)


def _corpus(args: argparse.Namespace) -> tuple[str, bool]:
    """The corpus prefix under --dir and whether this run made it."""
    prefix = os.path.join(args.dir, f"corpus-{args.size}")
    if os.path.exists(prefix + ".idx") and os.path.getsize(prefix + ".bin") == args.size // 2 * 2:
        return prefix, False
    start = time.perf_counter()
    make_corpus(prefix, args.size)
    print(f"corpus: {prefix}.bin, {args.size / 1e9:.2f} GB written in {time.perf_counter() - start:.1f} s",
          flush=True)
    return prefix, True


def _ratios(result: DataBenchResult) -> list[str]:
    lines = []
    for row in result.rows:
        if row.reader != "deepnvme":
            continue
        for peer in ("megatron-core", "np.memmap"):
            ratio = result.ratio(row, peer)
            if ratio is None:
                continue
            target = TARGETS[row.order]
            verdict = ""
            if peer == target[0]:
                verdict = (f" (target >= {target[1]:.1f}x: "
                           + ("met)" if ratio >= target[1] else f"missed by {target[1] - ratio:.2f}x)"))
            lines.append(f"{row.order}: deepnvme / {peer} = {ratio:.2f}x samples/s{verdict}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", type=parse_size, default=3 * 10**9)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--shuffled", type=int, default=8192)
    ap.add_argument("--sequential", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefetch", type=int, default=16)
    ap.add_argument("--readers", default="")
    ap.add_argument("--evict", default="auto", help="auto (drop-caches as root), drop-caches, fadvise, none")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the corpus for the next run")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    prefix, made = _corpus(args)
    try:
        readers = tuple(n for n in args.readers.split(",") if n)
        options = DataOptions(prefix=prefix, seq_len=args.seq_len, batch_size=args.batch_size,
                              shuffled=args.shuffled, sequential=args.sequential, reps=args.reps,
                              readers=readers, prefetch=args.prefetch, evict=args.evict)
        result = run_data_bench(options)
    finally:
        if not args.keep:
            for ext in (".bin", ".idx"):
                os.remove(prefix + ext)
    render_data_bench(result, stdout_console())
    lines = _ratios(result)
    for line in lines:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cpus",
                       "python": sys.version.split()[0], "torch": torch.__version__,
                       "command": " ".join(sys.argv), "corpus_bytes": args.size, "made_corpus": made,
                       "ratios": lines, **result.to_dict()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
