"""Weight loading inside vLLM: ``load_format="deepnvme"`` vs vLLM's own loaders (issue 17).

Usage (run with the python that has vLLM, e.g. /work/venv-vllm/bin/python):
  python benchmarks/bench_vllm_load.py --dir DIR [--layers 10] [--hidden 2048]
         [--intermediate 5504] [--vocab 1024] [--shard-size 300MB] [--reps 3]
         [--formats deepnvme,safetensors,runai_streamer] [--json OUT] [--keep]

A random bf16 Llama (transformers, ``save_pretrained(max_shard_size=...)``: shards plus
``model.safetensors.index.json``; the defaults give 1.02 GB in 4 shards) is written once under
DIR/llama. Then, for each repetition and each load format in a rotated order, a fresh Python
process runs ``vllm.LLM(model=DIR/llama, load_format=F, ...)`` on the CPU after
``sync; echo 3 > /proc/sys/vm/drop_caches`` (root; cold reads) and reports
(a) the seconds spent in the loader's ``load_weights`` (timed the same way for every loader by
wrapping it; the loader's own log line is kept alongside where one reaches the log: "deepnvme:
loaded the weights" for ``deepnvme``; vLLM 0.32's ``info_once`` "Loading weights took" for
``safetensors`` did not show in these in-process CPU runs, so its column is "-"), (b) the whole
``LLM()`` construction, (c) the process's peak RSS (``VmHWM``). Medians; ratios are the faster
peer's median over deepnvme's (> 1: deepnvme is faster). A format whose package is missing
(runai-model-streamer) is skipped with a note. DIR/llama is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

FORMATS = ("deepnvme", "safetensors", "runai_streamer")
LOG_PATTERNS = {  # vLLM's and deepnvme's own log lines (vllm 0.32: default_loader, gpu_model_runner)
    "logged_load_s": re.compile(r"(?:Loading weights took|deepnvme: loaded the weights of .* in) "
                                r"([0-9.]+) s"),
    "logged_model_loading_s": re.compile(r"Model loading took .* and ([0-9.]+) seconds"),
    "logged_init_model_s": re.compile(r"Initializing model took ([0-9.]+) seconds"),
}


# ---- worker side: one LLM() in one process -----------------------------------------------------

def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def worker(model_dir: str, load_format: str) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    timed: list[float] = []
    original = BaseModelLoader.load_model

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        inner = self.load_weights

        def load_weights(model: Any, model_config: Any) -> None:
            t0 = time.perf_counter()
            inner(model, model_config)
            timed.append(time.perf_counter() - t0)

        self.load_weights = load_weights
        return original(self, *args, **kwargs)

    BaseModelLoader.load_model = load_model   # every loader's load_weights, timed alike
    lines = _Lines()
    for name in ("vllm", "deepnvme"):
        logging.getLogger(name).addHandler(lines)
    logging.getLogger("deepnvme").setLevel(logging.INFO)
    t0 = time.perf_counter()
    llm = vllm.LLM(model=model_dir, load_format=load_format, skip_tokenizer_init=True,
                   distributed_executor_backend="uni", enforce_eager=True, dtype="bfloat16",
                   max_model_len=128, seed=0)
    construct = time.perf_counter() - t0
    if len(timed) != 1:
        raise RuntimeError(f"expected one load_weights call, saw {len(timed)}")
    # the weights really arrived: a checksum of one parameter (read after the timing)
    check = llm.apply_model(lambda m: float(next(m.parameters()).float().sum()))[0]
    result: dict[str, Any] = {"format": load_format, "load_weights_s": timed[0],
                              "construct_s": construct, "peak_rss": _hwm_bytes(), "check": check}
    for key, pattern in LOG_PATTERNS.items():
        found = [m.group(1) for line in lines.lines if (m := pattern.search(line))]
        result[key] = float(found[0]) if found else None
    return result


# ---- driver side -------------------------------------------------------------------------------

def make_model(folder: str, *, layers: int, hidden: int, intermediate: int, vocab: int,
               shard_size: str) -> int:
    """Write the random bf16 Llama once (reused when its index exists); returns its bytes."""
    written = [os.path.join(folder, n) for n in ("model.safetensors.index.json", "model.safetensors")]
    if not any(os.path.exists(p) for p in written):   # one shard has no index
        import torch
        import transformers
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
            num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
            num_key_value_heads=max(1, hidden // 128), max_position_embeddings=256,
            tie_word_embeddings=False, dtype="bfloat16")
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
        tmp = folder + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, max_shard_size=shard_size)
        del model
        os.replace(tmp, folder)
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
               if n.endswith(".safetensors"))


def _drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def _available(fmt: str) -> bool:
    return fmt != "runai_streamer" or importlib.util.find_spec("runai_model_streamer") is not None


def _run_worker(model_dir: str, fmt: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", fmt, model_dir],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{fmt} worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5504)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--shard-size", default="300MB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--json")
    p.add_argument("--keep", action="store_true", help="keep DIR/llama for a later run")
    p.add_argument("--worker", nargs=2, metavar=("FORMAT", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[1], args.worker[0])))
        return 0
    if not args.dir:
        p.error("--dir is required")
    if importlib.util.find_spec("vllm") is None:
        p.error(f"vLLM is not importable from {sys.executable} (tools/test_vllm.sh builds a venv)")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = set(formats) - set(FORMATS)
    if unknown:
        p.error(f"unknown --formats {sorted(unknown)}; choose from {list(FORMATS)}")
    for fmt in [f for f in formats if not _available(f)]:
        print(f"note: {fmt} column skipped (runai-model-streamer is not installed)")
        formats.remove(fmt)
    model_dir = os.path.join(args.dir, "llama")
    size = make_model(model_dir, layers=args.layers, hidden=args.hidden,
                      intermediate=args.intermediate, vocab=args.vocab, shard_size=args.shard_size)
    shards = len([n for n in os.listdir(model_dir) if n.endswith(".safetensors")])
    print(f"model: {model_dir}, {size / 1e9:.3f} GB in {shards} shards, {args.layers} layers")
    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in formats}
    cold = True
    try:
        for rep in range(args.reps):
            order = formats[rep % len(formats):] + formats[:rep % len(formats)]
            for fmt in order:
                cold = _drop_caches() and cold
                r = _run_worker(model_dir, fmt)
                runs[fmt].append(r)
                print(f"rep {rep} {fmt:15s} load_weights {r['load_weights_s']:.2f} s  "
                      f"LLM() {r['construct_s']:.2f} s  peak RSS {r['peak_rss'] / 2**30:.2f} GiB",
                      flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(model_dir, ignore_errors=True)
    if not cold:
        print("note: page cache NOT dropped (not root): warm reads")
    checks = {r["check"] for rs in runs.values() for r in rs}
    if len(checks) != 1:
        raise RuntimeError(f"the loaders disagree on the weights: checksums {checks}")
    print(f"\n{'format':15s} {'load_weights s':>14s} {'GB/s':>6s} {'LLM() s':>8s} {'peak RSS GiB':>12s}"
          f" {'vLLM log s':>10s}")
    summary: dict[str, dict[str, Any]] = {}
    for fmt, rs in runs.items():
        logged = [r["logged_load_s"] for r in rs if r["logged_load_s"] is not None]
        summary[fmt] = {"load_weights_s": _median(rs, "load_weights_s"),
                        "construct_s": _median(rs, "construct_s"),
                        "peak_rss": _median(rs, "peak_rss"),
                        "logged_load_s": statistics.median(logged) if logged else None}
        s = summary[fmt]
        log_s = f"{s['logged_load_s']:.2f}" if s["logged_load_s"] is not None else "-"
        print(f"{fmt:15s} {s['load_weights_s']:14.2f} {size / 1e9 / s['load_weights_s']:6.2f} "
              f"{s['construct_s']:8.2f} {s['peak_rss'] / 2**30:12.2f} {log_s:>10s}")
    ratios: dict[str, float] = {}
    peers = [f for f in summary if f != "deepnvme"]
    if "deepnvme" in summary and peers:
        ours = summary["deepnvme"]
        best = min(peers, key=lambda f: summary[f]["load_weights_s"])
        ratios = {"faster_peer": best,  # type: ignore[dict-item]
                  "load_weights_x": summary[best]["load_weights_s"] / ours["load_weights_s"],
                  "construct_x": summary[best]["construct_s"] / ours["construct_s"]}
        if "safetensors" in summary:
            ratios["peak_rss_vs_safetensors"] = ours["peak_rss"] / summary["safetensors"]["peak_rss"]
        print(f"\ndeepnvme vs faster peer ({best}): load_weights {ratios['load_weights_x']:.2f}x, "
              f"LLM() {ratios['construct_x']:.2f}x")
        if "peak_rss_vs_safetensors" in ratios:
            print(f"deepnvme peak RSS / safetensors peak RSS: {ratios['peak_rss_vs_safetensors']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "argv": sys.argv, "python": sys.executable, "model_bytes": size,
                       "shards": shards, "cold_cache": cold, "runs": runs, "median": summary,
                       "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
