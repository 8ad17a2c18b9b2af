"""Streaming with int8/int4 group-quantised block weights vs the same model streamed in bf16.

Builds a random bf16 Llama from a config (saved once as a safetensors checkpoint under --dir)
and one packed copy per setting with ``load_streamed(packed_dir=..., quantize=...)``:

  bf16   the decoder layers' weights as stored (2 bytes per weight)
  int8   linear weights as int8 codes + one bf16 scale per --group-size inputs
  int4   linear weights as int4 codes (two per byte) + one bf16 scale per group

Accuracy (one process, same prompt): max and mean |logits - bf16 logits| of one forward, and
how many of --acc-tokens greedy tokens equal bf16's (and the first position that differs).
Weights are random (normal, std --init-std), not trained: the figures show the dequantiser's
error on this model, not a language model's quality.

Throughput: decode tokens/s of greedy generation, one fresh subprocess per setting and round,
settings interleaved in each round; every read is cold (the streamer reads with O_DIRECT, and
the page cache of the checkpoint and the packed copies is dropped before each generate). CPU
seconds (getrusage of the process: model thread + I/O threads + dequantising) per generated
token are reported too, since the machine's CPUs are shared. The ratio printed last is the
median decode tokens/s of each setting over bf16's, within this run.
Run:  flock /tmp/deepnvme-bench.lock python benchmarks/bench_stream_quant.py --out FILE.json
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

import torch

from deepnvme.io.posix import evict_page_cache

MODES = ("bf16", "int8", "int4")


def _files(*dirs: str) -> list[str]:
    return [os.path.join(r, f) for d in dirs if os.path.isdir(d) for r, _, fs in os.walk(d) for f in fs]


def _evict(dirs: list[str]) -> None:
    for path in _files(*dirs):
        evict_page_cache(path)


def make_checkpoint(args: argparse.Namespace) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, vocab_size=args.vocab, max_position_embeddings=1024,
                      bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    tag = f"llama-h{args.hidden}-i{args.intermediate}-l{args.layers}-v{args.vocab}-s{args.init_std}-bf16"
    path = os.path.join(args.dir, tag)
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, args.init_std) if p.dim() > 1 else p.fill_(1.0)
        model.save_pretrained(path, max_shard_size="20GB")
        os.sync()
    return path


def _packed(args: argparse.Namespace, mode: str) -> str:
    return os.path.join(args.dir, f"packed-{mode}-g{args.group_size}")


def _load(args: argparse.Namespace, mode: str, prefetch: int):  # type: ignore[no-untyped-def]
    from deepnvme.config import resolve_config
    from deepnvme.inference import load_streamed

    cfg = resolve_config({"intra_op_parallelism": args.parallelism, "block_size": args.block_size})
    quant = None if mode == "bf16" else mode
    return load_streamed(args.checkpoint, packed_dir=_packed(args, mode), dtype=torch.bfloat16, prefetch=prefetch,
                         config=cfg, quantize=quant, group_size=args.group_size if quant else None)


def accuracy(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Logit errors and greedy-token agreement of each setting against bf16, in this process."""
    from deepnvme.inference import streamer_of

    ids = torch.randint(2, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(7))
    logits, tokens = {}, {}
    for mode in MODES:
        model = _load(args, mode, prefetch=1)
        with torch.no_grad():
            logits[mode] = model(ids).logits.float()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                                 max_new_tokens=args.acc_tokens, min_new_tokens=args.acc_tokens)
        tokens[mode] = out[0, args.prompt_len:].tolist()
        streamer_of(model).close()
    ref, ref_tok = logits["bf16"], tokens["bf16"]
    result = {}
    for mode in MODES[1:]:
        err = (logits[mode] - ref).abs()
        diverge = next((i for i, (a, b) in enumerate(zip(tokens[mode], ref_tok)) if a != b), len(ref_tok))
        result[mode] = {"max_abs_err": float(err.max()), "mean_abs_err": float(err.mean()),
                        "logit_std": float(ref.std()), "logit_max_abs": float(ref.abs().max()),
                        "same_top1": float((logits[mode].argmax(-1) == ref.argmax(-1)).float().mean()),
                        "greedy_match": sum(a == b for a, b in zip(tokens[mode], ref_tok)),
                        "greedy_first_diff": diverge, "greedy_n": len(ref_tok)}
    return result


def child(args: argparse.Namespace) -> None:
    from deepnvme.inference import stream_stats, streamer_of
    from deepnvme.inference._metrics import disk_read_bytes
    from deepnvme.inference.generate import time_generate

    torch.set_num_threads(args.threads)
    dirs = [args.checkpoint, _packed(args, args.child)]
    model = _load(args, args.child, args.prefetch)
    reps = []
    for _ in range(args.reps):
        _evict(dirs)
        streamer_of(model).reset_stats()
        d0, r0 = disk_read_bytes(), resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        tm = time_generate(model, batch_size=args.batch, prompt_len=args.gen_prompt_len, gen_len=args.gen_len)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        s = stream_stats(model)
        reps.append({"prefill_s": tm.prefill_seconds, "decode_s": tm.decode_seconds, "wall_s": wall,
                     "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
                     "disk_read": disk_read_bytes() - d0, "streamed": s.bytes_read, "stall_s": s.stall_seconds,
                     "dequant_s": s.dequant_seconds, "tokens": tm.tokens.tolist()})
    streamer_of(model).close()
    print("RESULT " + json.dumps({"mode": args.child, "reps": reps}))


def run_child(args: argparse.Namespace, mode: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--checkpoint", args.checkpoint]
    for key in ("dir", "group_size", "prefetch", "batch", "gen_prompt_len", "gen_len", "reps", "threads",
                "parallelism", "block_size"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def packed_bytes(args: argparse.Namespace, mode: str) -> int:
    return os.path.getsize(os.path.join(_packed(args, mode), "weights.bin"))


def read_bandwidth(args: argparse.Namespace) -> float:
    from deepnvme.bench import BenchOptions, run_bench
    from deepnvme.config import resolve_config

    cfg = resolve_config({"intra_op_parallelism": args.parallelism, "block_size": args.block_size})
    bench = run_bench(BenchOptions(dirs=(args.dir,), io_size=args.bandwidth_size, loops=3, write=False, config=cfg))
    return float(bench.get("deepnvme", "read").e2e_gbps.median)


def summarise(args: argparse.Namespace, runs: dict[str, list[dict]]) -> dict:
    per_token = args.batch * (args.gen_len - 1)
    rows = {}
    for mode, rs in runs.items():
        reps = [x for r in rs for x in r["reps"]]
        rows[mode] = {
            "decode_tok_s": statistics.median(per_token / x["decode_s"] for x in reps),
            "decode_tok_s_all": [per_token / x["decode_s"] for x in reps],
            "cpu_s_per_token": statistics.median(x["cpu_s"] / (args.batch * args.gen_len) for x in reps),
            "stall_s": statistics.median(x["stall_s"] for x in reps),
            "dequant_s": statistics.median(x["dequant_s"] for x in reps),
            "wall_s": statistics.median(x["wall_s"] for x in reps),
            "streamed_gb_per_token": statistics.median(x["streamed"] for x in reps) / 1e9 / args.gen_len,
            "disk_read_gb": statistics.median(x["disk_read"] for x in reps) / 1e9,
            "packed_gb": packed_bytes(args, mode) / 1e9,
            "same_tokens_as_bf16": all(x["tokens"] == runs["bf16"][0]["reps"][0]["tokens"] for x in reps)}
    for mode in rows:
        rows[mode]["speedup_vs_bf16"] = rows[mode]["decode_tok_s"] / rows["bf16"]["decode_tok_s"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/work/tmpbench/quant", help="checkpoint and packed copies (the disk under test)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32, help="accuracy prompt length")
    ap.add_argument("--acc-tokens", type=int, default=32, help="greedy tokens compared")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gen-prompt-len", type=int, default=8)
    ap.add_argument("--gen-len", type=int, default=6)
    ap.add_argument("--reps", type=int, default=1, help="generate calls per child process")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all settings (interleaved)")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: no OpenMP barriers on a busy machine)")
    ap.add_argument("--parallelism", type=int, default=4, help="deepnvme I/O threads")
    ap.add_argument("--block-size", type=int, default=8 << 20)
    ap.add_argument("--bandwidth-size", type=int, default=512 << 20, help="bytes of the cold read bandwidth probe")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    os.makedirs(args.dir, exist_ok=True)
    args.checkpoint = make_checkpoint(args)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    acc = {} if args.skip_accuracy else accuracy(args)   # also prepares the three packed copies
    if args.skip_accuracy:
        for mode in MODES:
            from deepnvme.inference import streamer_of
            streamer_of(_load(args, mode, 0)).close()
    prep_s = time.perf_counter() - t0
    gbps_before = read_bandwidth(args)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(run_child(args, mode))
    gbps_after = read_bandwidth(args)
    rows = summarise(args, runs)
    cfg = {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "vocab", "init_std", "group_size",
                                         "prompt_len", "acc_tokens", "batch", "gen_prompt_len", "gen_len", "reps",
                                         "rounds", "prefetch", "threads", "parallelism", "block_size", "dir")}
    result = {"config": cfg, "accuracy": acc, "throughput": rows, "read_gbps_before": gbps_before,
              "read_gbps_after": gbps_after, "prepare_s": prep_s, "torch": torch.__version__,
              "loadavg": os.getloadavg(), "runs": runs}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    print(f"random bf16 Llama h{args.hidden} i{args.intermediate} l{args.layers} v{args.vocab}; group "
          f"{args.group_size}; batch {args.batch}, gen {args.gen_len}, prefetch {args.prefetch}, {args.threads} "
          f"threads; cold O_DIRECT read {gbps_before:.2f} / {gbps_after:.2f} GB/s before/after")
    for mode, a in acc.items():
        print(f"accuracy {mode}: logits max |err| {a['max_abs_err']:.4f}, mean {a['mean_abs_err']:.5f} "
              f"(bf16 logits std {a['logit_std']:.3f}); greedy {a['greedy_match']}/{a['greedy_n']} equal, "
              f"first difference at {a['greedy_first_diff']}")
    print(f"{'mode':6s} {'packed GB':>9s} {'GB/token':>8s} {'decode tok/s':>12s} {'CPU s/token':>11s} "
          f"{'stall s':>7s} {'dequant s':>9s} {'vs bf16':>7s}")
    for mode, r in rows.items():
        print(f"{mode:6s} {r['packed_gb']:9.3f} {r['streamed_gb_per_token']:8.3f} {r['decode_tok_s']:12.2f} "
              f"{r['cpu_s_per_token']:11.2f} {r['stall_s']:7.2f} {r['dequant_s']:9.2f} {r['speedup_vs_bf16']:6.2f}x")


if __name__ == "__main__":
    main()
