"""A small GPT trained on a CUDA device: step time and device memory with its parameters
offloaded (deepnvme.offload_parameters + NVMeOptimizer, the master copy and the update on the
CPU, parameters and optimizer state in files) next to the same model fully on the GPU.

Usage (on a CUDA machine; exits with a message elsewhere):
    python benchmarks/gpu/bench_offload_cuda.py --out results.json [--dir DIR] [--layers 6]

Peers, each its own copy of one initial model, steps interleaved round-robin (medians over
``--steps`` after ``--warmup``):
- ``gpu``: parameters, gradients and AdamW state on the GPU (torch.optim.AdamW, its default
  implementation);
- ``gpu, cpu update``: parameters on the GPU, fp32 master copies and AdamW on the CPU
  (gradients copied to the CPU, the update copied back: the offload's reference maths);
- ``offload pN``: deepnvme, prefetch N units ahead (N = ``--prefetch`` and 0).
Device memory: what a peer holds between steps (allocated when it was built and warmed up) +
the peak above that during a step. Times are wall seconds per step with the GPU synchronised;
CPU seconds come from getrusage (the whole process). Writes go to ``--dir`` (O_DIRECT where it
allows; the offload's files are deleted at the end). Stops repeating after ``--time-limit``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import deepnvme


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                       v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class CpuUpdate:
    """fp32 master copies and the optimizer on the CPU for a model on the GPU."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.model = model
        self.masters = [p.detach().cpu().clone().requires_grad_() for p in model.parameters()]
        self.opt = torch.optim.AdamW(self.masters, lr=lr)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def step(self) -> None:
        for m, p in zip(self.masters, self.model.parameters()):
            m.grad = None if p.grad is None else p.grad.cpu()
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.model.parameters()):
                p.copy_(m, non_blocking=False)


class Peer:
    def __init__(self, name: str, build: Callable[[], tuple[nn.Module, Any, Any]]) -> None:
        self.name = name
        self.build = build
        self.model: nn.Module | None = None
        self.opt: Any = None
        self.offload: Any = None
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []
        self.held = 0
        self.step_peak = 0
        self.error: str | None = None

    def close(self) -> None:
        for obj in (self.offload, self.opt):
            if obj is not None and hasattr(obj, "close"):
                obj.close()
        self.model = self.opt = self.offload = None


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def step(peer: Peer, idx: torch.Tensor, tgt: torch.Tensor, vocab: int) -> tuple[float, float, float]:
    assert peer.model is not None
    torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), cpu_seconds()
    peer.opt.zero_grad()
    logits = peer.model(idx)
    loss = nn.functional.cross_entropy(logits.view(-1, vocab), tgt.view(-1))
    loss.backward()
    peer.opt.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, cpu_seconds() - c0, float(loss)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where to write the JSON results")
    p.add_argument("--dir", default=None, help="directory for the offload's files (default: a "
                   "new folder under $TMPDIR or /tmp, removed at the end)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--host-budget", default="256M", help="max_in_memory_bytes of the offload")
    p.add_argument("--time-limit", type=float, default=90.0,
                   help="stop repeating after this many seconds of steps")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("bench_offload_cuda.py needs a CUDA device", file=sys.stderr)
        return 2
    from deepnvme.config import parse_size
    host_budget = parse_size(args.host_budget)
    made_dir = args.dir is None
    root = tempfile.mkdtemp(prefix="deepnvme-offload-bench-") if made_dir else args.dir
    dev = torch.device("cuda")
    torch.manual_seed(0)
    base = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    n_params = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(dev),
             torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(dev))
            for _ in range(2)]

    def gpu() -> tuple[nn.Module, Any, Any]:
        m = copy.deepcopy(base).to(dev)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4), None

    def gpu_cpu_update() -> tuple[nn.Module, Any, Any]:
        m = copy.deepcopy(base).to(dev)
        return m, CpuUpdate(m, 1e-4), None

    def offloaded(prefetch: int) -> Callable[[], tuple[nn.Module, Any, Any]]:
        def build() -> tuple[nn.Module, Any, Any]:
            m = copy.deepcopy(base).to(dev)
            folder = os.path.join(root, f"p{prefetch}")
            off = deepnvme.offload_parameters(m, folder, max_in_memory_bytes=host_budget,
                                              prefetch=prefetch)
            opt = deepnvme.NVMeOptimizer(m.parameters(), torch.optim.AdamW, swap_dir=folder,
                                         lr=1e-4)
            return m, opt, off
        return build

    peers = [Peer("gpu", gpu), Peer("gpu, cpu update", gpu_cpu_update),
             Peer(f"offload p{args.prefetch}", offloaded(args.prefetch))]
    if args.prefetch:
        peers.append(Peer("offload p0", offloaded(0)))
    results: dict[str, Any] = {}
    try:
        for peer in peers:             # build and warm up one at a time: what each holds
            try:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                peer.model, peer.opt, peer.offload = peer.build()
                for i in range(args.warmup):
                    step(peer, *data[i % 2], args.vocab)
                torch.cuda.synchronize()
                peer.held = torch.cuda.memory_allocated() - before
            except Exception:
                peer.error = traceback.format_exc()
                print(f"{peer.name}: {peer.error}", file=sys.stderr)
                peer.close()
        start = time.perf_counter()
        for rep in range(args.steps):  # interleaved repetitions
            for peer in peers:
                if peer.model is None:
                    continue
                try:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    at = torch.cuda.memory_allocated()
                    wall, cpu, loss = step(peer, *data[rep % 2], args.vocab)
                    peer.step_peak = max(peer.step_peak, torch.cuda.max_memory_allocated() - at)
                    peer.times.append(wall)
                    peer.cpu.append(cpu)
                    peer.losses.append(loss)
                except Exception:
                    peer.error = traceback.format_exc()
                    print(f"{peer.name}: {peer.error}", file=sys.stderr)
                    peer.close()
            if time.perf_counter() - start > args.time_limit:
                print(f"time limit reached after {rep + 1} repetitions", file=sys.stderr)
                break
        results = report(peers, args, n_params)
    finally:
        stats = {p.name: _offload_stats(p) for p in peers if p.offload is not None}
        for peer in peers:
            peer.close()
        if made_dir:
            shutil.rmtree(root, ignore_errors=True)
    results["offload_stats"] = stats
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    return 0 if all(p.error is None for p in peers) else 1


def _offload_stats(peer: Peer) -> dict[str, Any]:
    off = peer.offload
    return {"host": dataclasses.asdict(off.stats()), "device": dataclasses.asdict(off.device_stats())}


def report(peers: list[Peer], args: argparse.Namespace, n_params: int) -> dict[str, Any]:
    gib = 1 << 30
    rows = []
    ref = next((p for p in peers if p.name == "gpu" and p.times), None)
    ref_t = statistics.median(ref.times) if ref else None
    print(f"GPT {n_params / 1e6:.1f}M parameters, batch {args.batch} x {args.seq} tokens, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'peer':<18}{'step s':>9}{'x gpu':>8}{'CPU s':>8}{'held GiB':>10}{'peak GiB':>10}")
    for p in peers:
        t = statistics.median(p.times) if p.times else None
        row = {"peer": p.name, "step_s_median": t, "step_s": p.times, "cpu_s": p.cpu,
               "losses": p.losses, "device_held_bytes": p.held,
               "device_step_peak_bytes": p.step_peak, "device_peak_bytes": p.held + p.step_peak,
               "vs_gpu": (t / ref_t) if t and ref_t else None, "error": p.error}
        rows.append(row)
        if t is None:
            print(f"{p.name:<18}{'failed':>9}")
            continue
        print(f"{p.name:<18}{t:>9.3f}{row['vs_gpu'] or float('nan'):>8.2f}"
              f"{statistics.median(p.cpu):>8.2f}{p.held / gib:>10.3f}"
              f"{(p.held + p.step_peak) / gib:>10.3f}")
    return {"benchmark": "bench_offload_cuda", "command": " ".join(sys.argv),
            "model": {"params": n_params, "vocab": args.vocab, "dim": args.dim,
                      "layers": args.layers, "heads": args.heads, "seq": args.seq,
                      "batch": args.batch, "dtype": "float32"},
            "settings": {"prefetch": args.prefetch, "host_budget": args.host_budget,
                         "steps": args.steps, "warmup": args.warmup},
            "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "cuda": torch.version.cuda, "cpus": os.cpu_count(),
                        "python": platform.python_version(), "deepnvme": deepnvme.__version__},
            "peers": rows}


if __name__ == "__main__":
    sys.exit(main())
