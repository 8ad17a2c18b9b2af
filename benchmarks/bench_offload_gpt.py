"""A GPT trained beyond memory at default settings: deepnvme vs DeepSpeed ZeRO-3 (NVMe offload).

Model: token and position embeddings, ``--layers`` pre-norm transformer blocks (attention with
``F.scaled_dot_product_attention``, a 4x GELU MLP), an untied LM head; fp32, AdamW, batch
``--batch`` x ``--seq`` tokens. The token embedding and the head are the largest parameters
(``--vocab`` x ``--dim``). Budget: ``--budget-frac`` of the parameters' bytes (a quarter by
default): the embedding is larger than half of it, so its optimizer update must go in slices.

Each mode runs in its own subprocess (its peak RSS its own: VmHWM above the RSS after importing
torch and a warm-up step, reset after the first step), ``--reps`` interleaved repetitions:

- ``memory``: the model and AdamW in memory;
- ``defaults``: ``offload_parameters(model, dir, max_in_memory_bytes=budget, source=init)`` and
  ``NVMeOptimizer(model.parameters(), AdamW, swap_dir=dir, lr=...)``, nothing else set
  (``fuse_backward="auto"``: the untimed first step is watched, the timed ones fused);
- ``unfused``: the defaults with ``fuse_backward=False`` (the update after the backward);
- ``keepgrads``: the same with ``offload_gradients=False`` (gradients in memory, as ZeRO-3);
- ``fused``: the defaults with ``fuse_backward=True`` (fused from the first step);
- ``deepspeed`` (with ``--ds-python``): ZeRO-3, ``offload_param`` and ``offload_optimizer`` on
  nvme under ``dir``, one parameter buffer of the largest parameter's size per parameter it swaps
  (fewer fail with "Not enough buffers": DeepSpeed's buffers are fixed-size, so it holds more than
  the budget), ``max_in_cpu`` 0 (its default keeps every parameter in memory), live parameters
  the budget, ``sub_group_size`` and prefetch a quarter of it, aio at its defaults (1 MiB
  block), torch's AdamW, DeepSpeed's CPU accelerator and gloo (one rank).

Reported: the median step (s), CPU seconds per step (getrusage, all threads), MB read and
written per step at the block layer (/proc/self/io: what really went to the storage, both sides),
peak RSS, each offloaded mode's step over DeepSpeed's, and DeepSpeed's swap files per folder.
MB, GB = 1e6, 1e9 bytes.

    python benchmarks/bench_offload_gpt.py --dir /mnt/nvme/x --ds-python /venv-ds/bin/python \
        --json benchmarks/results/out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from offload_bench import status  # noqa: E402  (same folder)

OFFLOADED = ("defaults", "unfused", "keepgrads", "fused")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def make_model(args: argparse.Namespace) -> GPT:
    return GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)


def init(name: str, t: torch.Tensor) -> None:
    """GPT-2's init: weights N(0, 0.02), LayerNorm weights 1, biases 0."""
    if t.dim() > 1:
        t.normal_(0.0, 0.02)
    elif name.endswith("weight"):
        t.fill_(1.0)
    else:
        t.zero_()


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def warm_up(threads: int) -> int:
    """Page in autograd and AdamW before the baseline; returns the RSS baseline."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    warm = nn.Linear(64, 64)
    torch.optim.AdamW(warm.parameters()).step(warm(torch.randn(8, 64)).sum().backward())
    return status("VmRSS")


def io_bytes() -> tuple[int, int]:
    """(read_bytes, write_bytes) of this process from /proc/self/io: what reached the block
    layer (O_DIRECT and io_uring/libaio requests of every thread; page-cache hits not counted)."""
    got = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, val = line.partition(":")
            got[key] = int(val)
    return got["read_bytes"], got["write_bytes"]


def time_steps(step: Callable[[], None], steps: int, baseline: int,
               after_first: Callable[[], None] | None = None) -> dict[str, Any]:
    """One untimed step (it creates the optimizer state), VmHWM reset, then ``steps`` timed:
    wall and CPU seconds each, block-layer bytes read and written each (/proc/self/io), and
    the peak RSS above ``baseline``."""
    times, cpu, read, written = [], [], [], []
    first = 0
    for i in range(steps + 1):
        r0, io0 = resource.getrusage(resource.RUSAGE_SELF), io_bytes()
        t0 = time.perf_counter()
        step()
        if i == 0:
            first = status("VmHWM") - baseline
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            if after_first is not None:
                after_first()
            continue
        times.append(time.perf_counter() - t0)
        r1, io1 = resource.getrusage(resource.RUSAGE_SELF), io_bytes()
        cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
        read.append(io1[0] - io0[0])
        written.append(io1[1] - io0[1])
    return {"step_s": times, "cpu_s": cpu, "io_read_bytes": read, "io_write_bytes": written,
            "rss": status("VmHWM") - baseline, "rss_first_step": first}


def budget_of(args: argparse.Namespace, n_params: int) -> int:
    return int(4 * n_params * args.budget_frac)


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    import deepnvme

    baseline = warm_up(args.threads)
    x, y = batch(args)
    if args.mode == "memory":
        model = make_model(args)
        with torch.no_grad():
            for name, p in model.named_parameters():
                init(name, p)
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        offload = None
    else:
        with torch.device("meta"):
            model = make_model(args)
        budget = budget_of(args, sum(p.numel() for p in model.parameters()))
        extra: dict[str, Any] = {"offload_gradients": False} if args.mode == "keepgrads" else {}
        offload = deepnvme.offload_parameters(model, args.dir, max_in_memory_bytes=budget,
                                              source=init, **extra)
        fused = {"fused": {"fuse_backward": True},
                 "unfused": {"fuse_backward": False}}.get(args.mode, {})
        opt = deepnvme.NVMeOptimizer(model.parameters(), torch.optim.AdamW, swap_dir=args.dir,
                                     lr=1e-4, **fused)

    def step() -> None:
        opt.zero_grad()
        loss_of(model(x), y).backward()
        opt.step()

    out = {"mode": args.mode, "n_params": sum(p.numel() for p in model.parameters()),
           **time_steps(step, args.steps, baseline,
                        after_first=offload.reset_stats if offload is not None else None),
           "torch_threads_after": torch.get_num_threads()}
    if offload is not None:
        s = offload.stats()
        out.update(param_grad_read_per_step=s.bytes_read / args.steps,
                   param_grad_written_per_step=s.bytes_written / args.steps)
        assert isinstance(opt, deepnvme.NVMeOptimizer)
        out.update(budget=s.budget_bytes, peak_held=s.peak_bytes, sub_groups=opt.num_sub_groups,
                   fuses_backward=opt.fuses_backward,
                   sliced_params=opt.num_sliced_params, sub_group_bytes=opt.sub_group_bytes,
                   opt_buffers=3 * opt.buffer_bytes, state_bytes=opt.swapped_bytes)
        offload.close()
        opt.close()
    return out


PERSISTENCE = 100_000  # ZeRO-3's default stage3_param_persistence_threshold: smaller parameters stay in memory


def run_deepspeed(args: argparse.Namespace) -> dict[str, Any]:
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # the side environment's (--ds-python)

    baseline = warm_up(args.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    n_params = sum(p.numel() for p in make_model_meta(args).parameters())
    budget_elems = budget_of(args, n_params) // 4
    largest = args.vocab * args.dim
    swapped = sum(p.numel() >= PERSISTENCE for p in make_model_meta(args).parameters())
    nvme = os.path.join(args.dir, "deepspeed")
    os.makedirs(nvme, exist_ok=True)
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": False,
                              "buffer_size": largest,
                              # one fixed-size buffer (the largest parameter) per swapped parameter in
                              # flight: with fewer, ZeRO-3 asserts "Not enough buffers 0 for swapping 1"
                              # (8 did too), so one per parameter it swaps (over the persistence threshold)
                              "buffer_count": max(8, swapped + 2),
                              # the default (1e9 elements) copies every partition "permanently to
                              # CPU" (stage3's flat buffer) and swaps no parameter at all
                              "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": False,
                                  "buffer_count": 4},
            # the budget: live parameters, prefetch and optimizer sub-groups (the defaults, 1e9
            # elements, would hold the whole model's fp32 state in one sub-group in memory)
            "stage3_max_live_parameters": budget_elems,
            "stage3_param_persistence_threshold": PERSISTENCE,
            "stage3_prefetch_bucket_size": budget_elems // 4,
            "sub_group_size": budget_elems // 4,
        },
        # aio left at DeepSpeed's defaults (block 1 MiB, queue depth 8, 1 thread): it swaps only
        # partitions of at least max(1 MiB, block_size) bytes (swap_tensor's min_aio_bytes) and
        # keeps smaller ones in memory; every parameter over PERSISTENCE here is >= 1 MiB, and
        # the run reports its swap files and the bytes it reads and writes per step.
    }
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme"):
        model = make_model(args)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x, y = batch(args)

    def step() -> None:
        engine.backward(loss_of(engine(x), y))
        engine.step()

    out = time_steps(step, args.steps, baseline)
    return {"mode": "deepspeed", "n_params": n_params, "deepspeed": deepspeed.__version__,
            "aio": engine.aio_config(), "swap_files": swap_files(nvme), **out,
            "torch_threads_after": torch.get_num_threads()}


def swap_files(folder: str) -> dict[str, int]:
    """Bytes of DeepSpeed's swap files under ``folder`` per subfolder (its parameter and
    optimizer swap folders): that it swaps, and what."""
    sizes: dict[str, int] = {}
    for root, _, files in os.walk(folder):
        for f in files:
            key = os.path.relpath(root, folder)
            sizes[key] = sizes.get(key, 0) + os.path.getsize(os.path.join(root, f))
    return sizes


def make_model_meta(args: argparse.Namespace) -> GPT:
    with torch.device("meta"):
        return make_model(args)


def ds_env(ds_python: str) -> dict[str, str]:
    """The DeepSpeed child's environment: bench_engines' (the side venv's bin and torch
    extensions, no PYTHONPATH) with the CPU accelerator."""
    from bench_engines import ds_env as venv_env

    env = venv_env(ds_python)
    env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def spawn(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    python = args.ds_python if mode == "deepspeed" else sys.executable
    cmd = [python, os.path.abspath(__file__), "--child", mode, "--dir", os.path.join(args.dir, mode)]
    for k in ("vocab", "dim", "layers", "heads", "seq", "batch", "budget_frac", "steps", "threads"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    env = ds_env(python) if mode == "deepspeed" else None
    load = os.getloadavg()[0]   # a shared machine: the 1-minute load average as each run starts
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    shutil.rmtree(os.path.join(args.dir, mode), ignore_errors=True)
    if proc.returncode:   # a failed run is a result (named in the table), not the end
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        return {"mode": mode, "error": lines[-1] if lines else f"exit {proc.returncode}", "load": load}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "load": load}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dir", required=True, help="directory on the storage to test")
    ap.add_argument("--vocab", type=int, default=12288)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--budget-frac", type=float, default=0.25, help="budget / parameter bytes")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one untimed)")
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions of each mode")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--modes", default="memory,defaults,unfused,keepgrads",
                    help="comma-separated (deepspeed is added by --ds-python)")
    ap.add_argument("--ds-python", default=None, help="python of a side environment with DeepSpeed")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


def report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for mode, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            rows[mode] = {"error": rs[0]["error"]}
            continue
        rows[mode] = {"step_s": statistics.median(t for r in ok for t in r["step_s"]),
                      "cpu_s": statistics.median(t for r in ok for t in r["cpu_s"]),
                      "read_mb": statistics.median(b for r in ok for b in r["io_read_bytes"]) / 1e6,
                      "written_mb": statistics.median(b for r in ok for b in r["io_write_bytes"]) / 1e6,
                      "rss_mib": max(r["rss"] for r in ok) / 2**20}
        if "swap_files" in ok[0]:
            rows[mode]["swap_files_mb"] = {k: v / 1e6 for k, v in ok[0]["swap_files"].items()}
    ds = rows.get("deepspeed", {}).get("step_s")
    first = next(r for rs in runs.values() for r in rs if "error" not in r)
    print(f"GPT {first['n_params'] / 1e6:.1f} M fp32 params (vocab {args.vocab}, dim {args.dim}, "
          f"{args.layers} layers), AdamW, {args.batch} x {args.seq} tokens, budget "
          f"{args.budget_frac} of the parameters' bytes; {args.threads} torch threads; medians of "
          f"{args.reps} x {args.steps} steps; {args.dir}")
    print(f"{'mode':<12}{'step s':>9}{'CPU s':>8}{'read MB':>9}{'written MB':>12}{'peak RSS MiB':>14}"
          f"{'/ DeepSpeed':>13}")
    for mode, row in rows.items():
        if "error" in row:
            print(f"{mode:<12} failed: {row['error']}")
            continue
        ratio = f"{row['step_s'] / ds:.2f}" if ds else "-"
        print(f"{mode:<12}{row['step_s']:>9.2f}{row['cpu_s']:>8.2f}{row['read_mb']:>9.0f}"
              f"{row['written_mb']:>12.0f}{row['rss_mib']:>14.0f}{ratio:>13}")
    for mode, row in rows.items():
        if "swap_files_mb" in row:
            print(f"{mode} swap files after the run (MB): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in row["swap_files_mb"].items()))
    return rows


def main() -> None:
    args = parse()
    if args.child:
        args.mode = args.child
        out = run_deepspeed(args) if args.child == "deepspeed" else run_ours(args)
        print(json.dumps(out))
        return
    modes = [m for m in args.modes.split(",") if m] + (["deepspeed"] if args.ds_python else [])
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    os.makedirs(args.dir, exist_ok=True)
    load_start = os.getloadavg()
    for rep in range(args.reps):
        order = modes if rep % 2 == 0 else modes[::-1]   # interleaved, each order once
        for mode in order:
            runs[mode].append(spawn(args, mode))
            print(f"[{time.strftime('%H:%M:%S')}] {mode}: "
                  f"{runs[mode][-1].get('step_s', runs[mode][-1].get('error'))}", flush=True)
    rows = report(args, runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "args": {k: v for k, v in vars(args).items()
                                                            if k != "child"},
                       "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")},
                       "load_average_start": load_start, "load_average_end": os.getloadavg(),
                       "runs": runs, "summary": rows}, f, indent=1)


if __name__ == "__main__":
    main()
