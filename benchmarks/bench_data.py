"""Training data from NVMe: token-dataset samples, deepnvme vs megatron-core and np.memmap (issue 18).

Usage:
  flock /tmp/bench.lock python benchmarks/bench_data.py --dir DIR [--size 3G] [--seq-len 2048]
         [--batch-size 32] [--shuffled 8192] [--sequential 32768] [--reps 3] [--json OUT] [--keep]
         [--evict auto|drop-caches|fadvise|none] [--readers deepnvme,megatron-core,np.memmap]
         [--workers N]

Writes a corpus of ``--size`` bytes of uint16 tokens (random tokens, documents of 1 to 16,384
tokens) with ``deepnvme.data.write_token_dataset`` under DIR (reused when it is already there
with the same size), then runs ``deepnvme bench data``'s measurement (deepnvme.bench.data):
a shuffled pass (``--shuffled`` distinct random samples of the whole corpus) and a sequential
pass (``--sequential`` consecutive samples from a random start), every reader in the same
repetition, ``sync; echo 3 > /proc/sys/vm/drop_caches`` before each pass (root; else fadvise),
each pass marked cold/warm by mincore. Readers: deepnvme ``TokenDataset.batches``; megatron-core
``IndexedDataset(mmap=True)`` read as its GPT dataset does (``get(doc, offset, length)`` per
document piece); ``np.memmap`` sliced per sample. Every reader builds the same int64 batches;
their checksums must agree. Medians over repetitions; the ratios against the targets last, then
each reader's CPU per sample (getrusage: every thread, user + system). ``--workers N`` also reads
both orders through a ``DataLoader`` with N worker processes: TokenDataset (one read call per
batch) against an np.memmap dataset sliced per sample.
The corpus is removed afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from deepnvme.bench import DataBenchResult, DataOptions, run_data_bench
from deepnvme.cli._render import stdout_console
from deepnvme.cli.bench_data import render_data_bench
from deepnvme.config import parse_size
from deepnvme.data import TokenDataset, write_token_dataset

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
    for row in result.rows:
        cpu = row.cpu_us_per_sample
        lines.append(f"{row.order}: {row.reader} CPU {cpu.median:.1f} us per sample (min {cpu.min:.1f}, "
                     f"max {cpu.max:.1f}; all threads and children, user + system)")
    return lines


class _MemmapSamples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The stock DataLoader peer: ``np.memmap`` of the .bin sliced per sample in ``__getitem__``."""

    def __init__(self, ds: TokenDataset) -> None:
        self.path, self.base, self.total = ds.bin_path, ds.index.base, ds.total_tokens
        self.n, self.dtype, self.tokens = ds.seq_len, ds.index.dtype.name, None

    def __len__(self) -> int:
        return (self.total - 1) // self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        import numpy
        if self.tokens is None:  # opened in each worker
            self.tokens = numpy.memmap(self.path, dtype=numpy.dtype(self.dtype), mode="r", offset=self.base,
                                       shape=(self.total,))
        return torch.from_numpy(self.tokens[i * self.n:i * self.n + self.n + 1].astype(numpy.int64))


def _loader_runs(prefix: str, args: argparse.Namespace) -> dict[str, object]:
    """Both orders through ``torch.utils.data.DataLoader`` with ``--workers`` fork workers, batches of
    ``--batch-size``: deepnvme's TokenDataset (``__getitems__``: one read call per batch) against an
    np.memmap dataset read per sample; cold (page cache dropped as root, else fadvise), interleaved,
    CPU of the process and its workers (getrusage, children counted once the workers exit)."""
    from deepnvme.bench._data_readers import sample_orders
    from deepnvme.bench._reading import check_cold, evict, pick_eviction
    from deepnvme.bench.data import cpu_seconds

    ds = TokenDataset(prefix, seq_len=args.seq_len)
    orders = sample_orders(len(ds), shuffled=args.shuffled, sequential=args.sequential, seed=0)
    readers = {"deepnvme": ds, "np.memmap": _MemmapSamples(ds)}
    how = pick_eviction(args.evict)
    runs: dict[str, list[dict[str, object]]] = {f"{o} {r}": [] for o in orders for r in readers}
    for _ in range(args.reps):
        for order_name, order in orders.items():
            for name, dataset in readers.items():
                how = evict((ds.bin_path, ds.idx_path), how)
                _resident, cache = check_cold((ds.bin_path, ds.idx_path))
                loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=order,
                                                     num_workers=args.workers, multiprocessing_context="fork",
                                                     prefetch_factor=4)
                cpu, start = cpu_seconds(), time.perf_counter()
                checksum = sum(int(b.sum()) for b in loader)
                seconds = time.perf_counter() - start
                del loader  # the workers exit and are waited for: their CPU joins RUSAGE_CHILDREN
                runs[f"{order_name} {name}"].append({"seconds": seconds, "cpu_seconds": cpu_seconds() - cpu,
                                                     "cache": cache, "checksum": checksum})
    rows = {}
    for key, got in runs.items():
        n = len(orders[key.split()[0]])
        rows[key] = {"samples": n, "samples_per_s": statistics.median(n / r["seconds"] for r in got),
                     "cpu_us_per_sample": statistics.median(r["cpu_seconds"] / n * 1e6 for r in got),
                     "checksums": sorted({r["checksum"] for r in got}), "runs": got}
    for order_name in orders:
        if rows[f"{order_name} deepnvme"]["checksums"] != rows[f"{order_name} np.memmap"]["checksums"]:
            raise RuntimeError(f"DataLoader {order_name}: the readers disagree on the tokens")
    return {"workers": args.workers, "eviction": how, "rows": rows}


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
    ap.add_argument("--workers", type=int, default=0,
                    help="also time DataLoader(num_workers=N) readers (0: skip)")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    prefix, made = _corpus(args)
    try:
        readers = tuple(n for n in args.readers.split(",") if n)
        options = DataOptions(prefix=prefix, seq_len=args.seq_len, batch_size=args.batch_size,
                              shuffled=args.shuffled, sequential=args.sequential, reps=args.reps,
                              readers=readers, prefetch=args.prefetch, evict=args.evict)
        result = run_data_bench(options)
        loader = _loader_runs(prefix, args) if args.workers else None
    finally:
        if not args.keep:
            for ext in (".bin", ".idx"):
                os.remove(prefix + ext)
    render_data_bench(result, stdout_console())
    lines = _ratios(result)
    if loader is not None:
        for key, row in loader["rows"].items():  # type: ignore[attr-defined]
            lines.append(f"DataLoader({args.workers} workers) {key}: {row['samples_per_s']:,.0f} samples/s, "
                         f"CPU {row['cpu_us_per_sample']:.1f} us per sample")
    for line in lines:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cpus",
                       "python": sys.version.split()[0], "torch": torch.__version__,
                       "command": " ".join(sys.argv), "corpus_bytes": args.size, "made_corpus": made,
                       "ratios": lines, **result.to_dict(), "dataloader": loader}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
