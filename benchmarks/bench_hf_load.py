"""Loading a Hugging Face model folder: deepnvme's ``from_pretrained`` vs transformers' own.

Usage:
  python benchmarks/bench_hf_load.py --dir DIR [--layers 12] [--hidden 1024] [--dtype bfloat16]
         [--reps 5] [--shard-size 200MB] [--json OUT] [--tiny]

A randomly initialised Llama (``--layers`` blocks of ``--hidden``, MLP 2.75x, vocab 32000, head
not tied) is saved once with ``save_pretrained`` in ``--dtype`` as safetensors shards of
``--shard-size``. Each repetition runs both readers, each in a fresh Python process (imports
done before the clock starts), in alternating order, after ``sync; echo 3 >
/proc/sys/vm/drop_caches`` (root: cold reads; deepnvme reads with O_DIRECT anyway):

  * ``transformers``: ``AutoModelForCausalLM.from_pretrained(DIR, dtype=DTYPE)``
  * ``deepnvme``: ``deepnvme.integrations.transformers.from_pretrained("AutoModelForCausalLM",
    DIR, dtype=DTYPE)``

The timed region ends after one byte of every parameter page has been read (a lazily mapped
load is otherwise not finished). Reported per run: wall seconds, CPU seconds
of the process (user + system, all threads, ``getrusage``: less sensitive than wall time to
other load on a shared machine), and peak RSS growth over the process before the load (VmHWM).
Both readers' parameters are checked equal (the sum of those bytes). Medians; the ratio is
transformers' median seconds over deepnvme's. GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

READERS = ("deepnvme", "transformers")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _touch(t: torch.Tensor) -> int:
    """Read one byte of every 4 KiB page of ``t`` (a lazily mapped load is finished by this);
    their sum is the readers' cross-check. Cheap, so it does not dilute the ratio."""
    return int(t.detach().reshape(-1).view(torch.uint8)[::4096].sum(dtype=torch.int64))


def run_worker(reader: str, path: str, dtype_name: str) -> dict[str, Any]:
    import accelerate  # noqa: F401  (both readers' imports happen before the clock)
    import transformers
    import transformers.models.llama.modeling_llama  # noqa: F401

    from deepnvme.integrations.transformers import from_pretrained
    dtype = getattr(torch, dtype_name)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    base, cpu0 = _hwm(), _cpu()
    t0 = time.perf_counter()
    if reader == "deepnvme":
        model = from_pretrained("AutoModelForCausalLM", path, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    check = sum(_touch(p) for p in model.parameters())
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "cpu_seconds": _cpu() - cpu0, "peak_rss_growth": _hwm() - base,
            "check": check, "bytes": sum(p.nbytes for p in model.parameters())}


def _drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except PermissionError:
        print("not root: page cache not dropped (transformers' reads may be warm)", file=sys.stderr)


def write_model(directory: str, layers: int, hidden: int, dtype_name: str, shard_size: str) -> None:
    import transformers
    if os.path.exists(os.path.join(directory, "config.json")):
        return
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden,
                                   intermediate_size=int(hidden * 2.75) // 64 * 64,
                                   num_attention_heads=max(1, hidden // 64),
                                   num_key_value_heads=max(1, hidden // 256), vocab_size=32000,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype_name))
    model.save_pretrained(directory, max_shard_size=shard_size)
    os.sync()


def _choose_load_path(folder: str) -> dict[str, Any]:
    """The device's load-path choice (measured on the largest shard unless cached), made here so
    that no timed worker measures; the workers read it from the same cache."""
    from deepnvme.checkpoint._load_path import load_paths
    from deepnvme.config import checkpoint_config
    shard = max((os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")),
                key=os.path.getsize)
    choice = load_paths(shard, checkpoint_config(None)).to_dict()
    print(f"load path on {choice['device']}: fresh {choice['fresh']}, into {choice['into']} "
          f"({choice['source']}: {choice['reason']})", file=sys.stderr)
    return choice


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shard-size", default="200MB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (smoke test)")
    ap.add_argument("--worker", nargs=3, metavar=("READER", "PATH", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_worker(*args.worker)))
        return 0
    if args.dir is None:
        ap.error("--dir is required")
    if args.tiny:
        args.layers, args.hidden = 2, 64
    os.makedirs(args.dir, exist_ok=True)
    write_model(args.dir, args.layers, args.hidden, args.dtype, args.shard_size)
    load_path = _choose_load_path(args.dir)
    load_start = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in READERS}
    for rep in range(args.reps):
        for reader in (READERS if rep % 2 == 0 else READERS[::-1]):
            _drop_caches()
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", reader, args.dir,
                                   args.dtype], capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                print(f"{reader} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[reader].append(res)
            print(f"rep {rep} {reader:12s} {res['seconds']:7.3f} s  cpu {res['cpu_seconds']:6.2f} s  "
                  f"peak+{res['peak_rss_growth'] / 2**20:6.0f} MiB", file=sys.stderr, flush=True)
    checks = {r: {x["check"] for x in v} for r, v in runs.items()}
    if len(checks["deepnvme"] | checks["transformers"]) != 1:
        print(f"parameters differ between readers: {checks}", file=sys.stderr)
        return 1
    nbytes = runs["deepnvme"][0]["bytes"]
    med = {r: {k: statistics.median(x[k] for x in v) for k in ("seconds", "cpu_seconds", "peak_rss_growth")}
           for r, v in runs.items()}
    summary = {"speedup": med["transformers"]["seconds"] / med["deepnvme"]["seconds"],
               "cpu_ratio": med["transformers"]["cpu_seconds"] / med["deepnvme"]["cpu_seconds"],
               "rss_ratio": med["deepnvme"]["peak_rss_growth"] / med["transformers"]["peak_rss_growth"]}
    print("| reader | s (median) | GB/s | CPU s | peak RSS growth MiB |\n|---|---|---|---|---|")
    for r in READERS:
        m = med[r]
        print(f"| {r} | {m['seconds']:.3f} | {nbytes / m['seconds'] / 1e9:.2f} | {m['cpu_seconds']:.2f} | "
              f"{m['peak_rss_growth'] / 2**20:.0f} |")
    print(f"deepnvme vs transformers: {summary['speedup']:.2f}x faster, {summary['cpu_ratio']:.2f}x less CPU, "
          f"peak RSS {summary['rss_ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "dir": args.dir, "bytes": nbytes, "layers": args.layers,
                       "hidden": args.hidden, "dtype": args.dtype, "shard_size": args.shard_size,
                       "reps": args.reps, "torch": torch.__version__, "load_path": load_path,
                       "load_average_start": load_start, "load_average_end": os.getloadavg(),
                       "transformers": __import__("transformers").__version__,
                       "medians": med, "summary": summary, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
