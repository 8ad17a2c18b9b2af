"""Weight-streaming inference benchmark: deepnvme vs accelerate disk offload vs in memory.

Builds a random Llama from a config (saved once as a safetensors checkpoint under --dir), then
runs greedy generation in a fresh subprocess per mode, so peak RSS is per mode:

  memory      the whole model loaded with from_pretrained (compute bound reference)
  deepnvme    deepnvme.inference.load_streamed: decoder layers streamed from the checkpoint
              files with O_DIRECT, `prefetch` layers read ahead
  accelerate  from_pretrained(device_map={layers: "disk"}, offload_folder=...): accelerate's
              hooks load each layer from the checkpoint files (buffered reads)

Cold cache: before every generate, and for accelerate before every forward pass, the page
cache of the checkpoint and accelerate's offload folder is dropped (posix_fadvise DONTNEED); deepnvme reads
with O_DIRECT. The I/O roofline is batch x read_GBps / streamed_bytes_per_forward, with
read_GBps measured by deepnvme's own cold O_DIRECT read benchmark in the same run.
Run:  flock /tmp/deepnvme-bench.lock python benchmarks/inference_stream.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from deepnvme.config import parse_size
from deepnvme.io.posix import evict_page_cache


def evict(paths: list[str]) -> None:
    for p in paths:
        evict_page_cache(p)


def files_under(*dirs: str) -> list[str]:
    return [os.path.join(r, f) for d in dirs if d and os.path.isdir(d)
            for r, _, fs in os.walk(d) for f in fs]


def make_checkpoint(args: argparse.Namespace) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, vocab_size=args.vocab,
                      max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
                      tie_word_embeddings=False)
    tag = f"llama-h{args.hidden}-i{args.intermediate}-l{args.layers}-v{args.vocab}-{args.dtype}"
    path = os.path.join(args.dir, tag)
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
        with torch.no_grad():
            for p in model.parameters():   # keep activations tame so greedy tokens are stable
                p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        model.save_pretrained(path, max_shard_size="20GB")
        os.sync()
    return path


def child(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from deepnvme.inference import load_streamed, stream_stats, streamer_of
    from deepnvme.inference._metrics import RssSampler, disk_read_bytes
    from deepnvme.inference.generate import time_generate

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ckpt, off = args.checkpoint, os.path.join(args.dir, "accelerate-offload")
    cold = files_under(ckpt, off)
    evict(cold)
    out: dict = {"mode": args.child, "prefetch": args.prefetch, "reps": []}
    with RssSampler() as rss:
        t0 = time.perf_counter()
        if args.child == "memory":
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
            with torch.no_grad():   # copy out of the checkpoint's mmap into anonymous memory
                for p in model.parameters():
                    p.data = p.data.clone()
        elif args.child == "deepnvme":
            model = load_streamed(ckpt, prefetch=args.prefetch, dtype=dtype, config=io_config(args))
        else:
            n = model_layers(ckpt)
            device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu",
                          "lm_head": "cpu", **{f"model.layers.{i}": "disk" for i in range(n)}}
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, device_map=device_map,
                                                         offload_folder=off).eval()
            cold = files_under(ckpt, off)
            model.register_forward_pre_hook(lambda *_: evict(cold))
        out["load_s"] = time.perf_counter() - t0
        for _ in range(args.reps):
            evict(cold)
            if args.child == "deepnvme":
                streamer_of(model).reset_stats()
            d0 = disk_read_bytes()
            tm = time_generate(model, batch_size=args.batch, prompt_len=args.prompt_len,
                               gen_len=args.gen_len)
            rep = {"prefill_s": tm.prefill_seconds, "decode_s": tm.decode_seconds,
                   "total_s": tm.total_seconds, "disk_read": disk_read_bytes() - d0,
                   "tokens": tm.tokens.tolist()}
            if args.child == "deepnvme":
                s = stream_stats(model)
                rep.update(stall_s=s.stall_seconds, streamed=s.bytes_read)
            out["reps"].append(rep)
    out.update(peak_anon=rss.peak_anon, peak_file=rss.peak_file)
    print("RESULT " + json.dumps(out))


def io_config(args: argparse.Namespace):
    from deepnvme.config import parse_size, resolve_config

    return resolve_config({"intra_op_parallelism": args.parallelism,
                           "block_size": parse_size(args.block_size)})


def model_layers(ckpt: str) -> int:
    with open(os.path.join(ckpt, "config.json")) as f:
        return json.load(f)["num_hidden_layers"]


def weight_split(ckpt: str) -> tuple[int, int]:
    """(bytes in decoder layers, bytes resident) of the checkpoint."""
    from deepnvme.inference._safetensors import read_checkpoint_index

    idx = read_checkpoint_index(ckpt)
    layers = sum(r.nbytes for k, r in idx.items() if ".layers." in k)
    return layers, sum(r.nbytes for r in idx.values()) - layers


def run_child(args: argparse.Namespace, mode: str, prefetch: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--checkpoint", args.checkpoint,
           "--prefetch", str(prefetch), "--dir", args.dir, "--batch", str(args.batch),
           "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
           "--reps", str(args.reps), "--dtype", args.dtype, "--threads", str(args.threads),
           "--parallelism", str(args.parallelism), "--block-size", args.block_size]
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "deepnvme-bench-inference"),
                    help="checkpoint and accelerate's offload folder (same disk as the data under test)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--reps", type=int, default=1, help="generate calls per child process")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all modes (interleaved)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--parallelism", type=int, default=8, help="deepnvme I/O threads")
    ap.add_argument("--block-size", default="8M", help="deepnvme I/O chunk size")
    ap.add_argument("--prefetch", default="0,2", help="deepnvme prefetch depths to run (comma list)")
    ap.add_argument("--modes", default="memory,deepnvme,accelerate")
    ap.add_argument("--bandwidth-size", type=parse_size, default=parse_size("1G"),
                    help="bytes of the cold read that measures the roofline bandwidth")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.prefetch = int(args.prefetch)
        child(args)
        return
    os.makedirs(args.dir, exist_ok=True)
    args.checkpoint = make_checkpoint(args)
    layer_bytes, resident_bytes = weight_split(args.checkpoint)

    from deepnvme.bench import BenchOptions, run_bench

    def read_bandwidth() -> float:
        bench = run_bench(BenchOptions(dirs=(args.dir,), io_size=args.bandwidth_size, loops=3, write=False,
                                       config=io_config(args)))
        return bench.get("deepnvme", "read").e2e_gbps.median

    gbps_before = read_bandwidth()
    configs = [(mode, p) for mode in args.modes.split(",")
               for p in ([int(x) for x in args.prefetch.split(",")] if mode == "deepnvme" else [0])]
    results: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    for _ in range(args.rounds):     # interleaved, so every mode sees the same machine load
        for mode, p in configs:
            results[mode, p].append(run_child(args, mode, p))
    runs = [{"mode": mode, "prefetch": p, "reps": [x for r in rs for x in r["reps"]],
             "peak_anon": max(r["peak_anon"] for r in rs), "peak_file": max(r["peak_file"] for r in rs)}
            for (mode, p), rs in results.items()]
    gbps_after = read_bandwidth()
    read_gbps = max(gbps_before, gbps_after)   # the higher one: a conservative (higher) roofline
    roof = args.batch * read_gbps * 1e9 / layer_bytes
    ref_run = next((r for r in runs if r["mode"] == "memory"), runs[0])
    ref_tokens = ref_run["reps"][0]["tokens"]
    print(f"random Llama: {args.layers} layers, hidden {args.hidden}, {args.dtype}; streamed "
          f"{layer_bytes / 1e9:.3f} GB/forward, resident {resident_bytes / 1e9:.3f} GB; batch "
          f"{args.batch}, prompt {args.prompt_len}, gen {args.gen_len}; median of {args.rounds} interleaved "
          f"rounds x {args.reps} reps (tok/s range in brackets); "
          f"{args.threads} threads; deepnvme I/O {args.parallelism} threads x {args.block_size} "
          f"blocks; cold O_DIRECT read {gbps_before:.2f} GB/s before, {gbps_after:.2f} after -> I/O roofline "
          f"{roof:.2f} tokens/s")
    head = (f"{'mode':16s} {'tok/s':>7s} {'range':>13s} {'prefill s':>9s} {'decode tok/s':>12s} {'GB read':>8s} "
            f"{'overlap':>8s} {'tot/roof':>8s} {'dec/roof':>8s} {'RSS anon MB':>11s} {'RSS file MB':>11s} "
            f"{'same tok':>8s}")
    print(head)
    print("-" * len(head))
    base = None
    for r in runs:
        reps = r["reps"]
        tot = statistics.median(args.batch * args.gen_len / x["total_s"] for x in reps)
        pre = statistics.median(x["prefill_s"] for x in reps)
        dec = statistics.median(args.batch * (args.gen_len - 1) / x["decode_s"] for x in reps)
        gb = statistics.median(x["disk_read"] for x in reps) / 1e9
        ov = (f"{statistics.median(1 - x['stall_s'] / x['total_s'] for x in reps):8.1%}"
              if "stall_s" in reps[0] else f"{'-':>8s}")
        name = r["mode"] + (f" p={r['prefetch']}" if r["mode"] == "deepnvme" else "")
        same = all(x["tokens"] == ref_tokens for x in reps)
        ratio = (f"{tot / roof:8.1%} {dec / roof:8.1%}" if r["mode"] != "memory"
                 else f"{'-':>8s} {'-':>8s}")   # nothing streamed: no I/O roofline
        rates = sorted(args.batch * args.gen_len / x["total_s"] for x in reps)
        spread = f"[{rates[0]:.1f}-{rates[-1]:.1f}]"
        print(f"{name:16s} {tot:7.2f} {spread:>13s} {pre:9.2f} {dec:12.2f} {gb:8.2f} {ov} {ratio} "
              f"{r['peak_anon'] / 1e6:11.0f} {r['peak_file'] / 1e6:11.0f} {str(same):>8s}")
        if r["mode"] == "accelerate":
            base = tot
    if base:
        best = max(statistics.median(args.batch * args.gen_len / x["total_s"] for x in r["reps"])
                   for r in runs if r["mode"] == "deepnvme")
        print(f"deepnvme (best prefetch) / accelerate tokens/s: {best / base:.2f}x")
    print(f"GB = 1e9 bytes; tok/s = generated tokens/s incl. prefill; x/roof = rate / I/O roofline; "
          f"overlap = 1 - stall/wall; same tok = greedy tokens equal {ref_run['mode']}'s")


if __name__ == "__main__":
    main()
