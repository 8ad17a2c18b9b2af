"""Parameter + gradient + optimizer-state offload across two gloo ranks (FSDP2) vs one process.

The model of benchmarks/bench_offload_params.py (``--layers`` Linear(dim, dim) + ReLU, AdamW)
is trained by:

- ``single``: one process, ``offload_parameters`` (built on the meta device) + ``NVMeOptimizer``,
  budget ``--budget-mib``;
- ``fsdp``: ``--world`` gloo ranks, ``fully_shard`` on each Linear and the root, each rank
  offloading its own shards (budget ``--budget-mib / world`` each) + ``NVMeOptimizer``;
- ``fsdp_fused``: ``fsdp`` with ``NVMeOptimizer(fuse_backward=True)`` (each shard updated in the
  post-accumulate-grad hook FSDP2 runs after the reduce-scatter);
- ``fsdp_memory``: the same ranks with FSDP2 and AdamW in memory (the in-memory reference);
- ``deepspeed`` (with ``--ds-python``): DeepSpeed ZeRO-3 with ``offload_param`` and
  ``offload_optimizer`` on NVMe, the same ranks over gloo (benchmarks/offload_params_deepspeed.py).

Modes alternate over ``--reps`` repetitions, each in fresh processes; per rank: step time,
CPU seconds (getrusage, all threads), peak RSS above the RSS after importing torch (VmHWM reset
after the first step), bytes read and written per step (the offload's counters plus the
optimizer state), and the bytes the process wrote to storage (``/proc/self/io``
``write_bytes``: what reached the block layer) per step. Torch threads are ``--threads``
per process. GB = 1e9 bytes.

    python benchmarks/bench_offload_ranks.py --dir /mnt/nvme/x --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from bench_offload_params import init, make_model  # noqa: E402  (same folder)
from offload_bench import status  # noqa: E402

import deepnvme  # noqa: E402


def io_written() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def time_steps(
    step: Callable[[], None], steps: int, baseline: int, *, on_first_timed: Callable[[], None] | None = None
) -> dict[str, Any]:
    """``steps`` + 1 runs of ``step``; the first (optimizer state created, order learned)
    untimed, VmHWM reset after it."""
    times, cpu, written = [], [], []
    for i in range(steps + 1):
        if i == 1:
            if on_first_timed is not None:
                on_first_timed()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        r0, w0 = resource.getrusage(resource.RUSAGE_SELF), io_written()
        t0 = time.perf_counter()
        step()
        if i > 0:
            times.append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
            written.append(io_written() - w0)
    return {"step_s": times, "cpu_s": cpu, "io_write_bytes": written, "rss": status("VmHWM") - baseline}


def _warm() -> int:
    torch.manual_seed(0)
    warm = torch.nn.Linear(64, 64)  # page in autograd and the optimizer before the baseline
    torch.optim.AdamW(warm.parameters()).step(warm(torch.randn(8, 64)).sum().backward())
    return status("VmRSS")


def _shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    ranks = args.child != "single"
    if ranks:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    baseline = _warm()
    world = args.world if ranks else 1
    budget = int(args.budget_mib * 2**20) // world
    config = deepnvme.IOConfig(block_size=args.block_size, intra_op_parallelism=args.io_threads)
    offload = None
    directory = os.path.join(args.dir, f"rank{args.rank}")
    if args.child == "single":
        with torch.device("meta"):
            model = make_model(args.layers, args.dim)
        offload = deepnvme.offload_parameters(
            model, directory, max_in_memory_bytes=budget, prefetch=args.prefetch, config=config, source=init
        )
    else:
        model = make_model(args.layers, args.dim)
        with torch.no_grad():
            for name, p in model.named_parameters():
                init(name, p)
        _shard(model)
        if args.child in ("fsdp", "fsdp_fused"):
            offload = deepnvme.offload_parameters(
                model, directory, max_in_memory_bytes=budget, prefetch=args.prefetch, config=config
            )
    opt: torch.optim.Optimizer
    if offload is not None:
        fuse: bool | str = True if args.child == "fsdp_fused" else "auto"
        opt = deepnvme.NVMeOptimizer(
            model.parameters(), torch.optim.AdamW, swap_dir=directory, config=config, fuse_backward=fuse, lr=1e-4
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(1 + args.rank))

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    out: dict[str, Any] = {
        "mode": args.child,
        "rank": args.rank,
        "budget": budget,
        **time_steps(step, args.steps, baseline, on_first_timed=offload.reset_stats if offload else None),
    }
    if offload is not None and isinstance(opt, deepnvme.NVMeOptimizer):
        s, state = offload.stats(), opt.swapped_bytes
        out.update(
            read_per_step=s.bytes_read / args.steps + state,
            written_per_step=s.bytes_written / args.steps + state,
            state_bytes=state,
            peak_held=s.peak_bytes,
            prefetch_hits=s.prefetch_hits / args.steps,
        )
        offload.close()
        opt.close()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(args: argparse.Namespace, mode: str) -> list[dict[str, Any]]:
    """One run of ``mode``: its processes (one per rank), each one's JSON line."""
    world = 1 if mode == "single" else args.world
    python = args.ds_python if mode == "deepspeed" else sys.executable
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": str(args.threads),
    }
    if mode == "deepspeed":  # the side venv's bin and torch extensions (its prebuilt ops)
        from bench_offload_gpt import ds_env

        env = {**ds_env(python), **{k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "OMP_NUM_THREADS")}}
    load = os.getloadavg()[0]  # a shared machine: the 1-minute load average as each run starts
    procs = []
    for rank in range(world):
        cmd = [python, __file__, "--child", mode, "--rank", str(rank), "--dir", args.dir]
        for k in (
            "world",
            "layers",
            "dim",
            "batch",
            "budget_mib",
            "steps",
            "prefetch",
            "block_size",
            "io_threads",
            "threads",
        ):
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        procs.append(
            subprocess.Popen(
                cmd,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=args.timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:  # a rank that hangs leaves none behind
            p.kill()
            p.wait()
        if mode != "deepspeed":
            raise
        return [{"mode": mode, "error": f"timed out after {args.timeout:g} s"}]
    if mode == "deepspeed":
        shutil.rmtree(os.path.join(args.dir, "deepspeed"), ignore_errors=True)
    results = []
    for p, (stdout, stderr) in zip(procs, outs):
        if p.returncode:
            if mode == "deepspeed":  # the peer's failure is a result, not the end
                lines = [ln for ln in stderr.splitlines() if ln.strip()]
                return [
                    {
                        "mode": mode,
                        "error": lines[-1] if lines else f"exit {p.returncode}",
                        "stderr_tail": stderr[-4000:],
                        "load": load,
                    }
                ]
            raise SystemExit(f"{mode} failed:\n{stderr[-3000:]}")
        results.append({**json.loads(stdout.strip().splitlines()[-1]), "load": load})
    return results


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the storage to test (default: a temp dir in cwd)")
    ap.add_argument("--world", type=int, default=2, help="ranks of the multi-rank modes")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--budget-mib", type=float, default=16.0, help="the single process's budget; each rank gets this / world"
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8 << 20)
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--modes", default="single,fsdp,fsdp_memory")
    ap.add_argument("--ds-python", default=None, help="python of a side venv with DeepSpeed: adds its ZeRO-3")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args()


def _deepspeed_child(args: argparse.Namespace) -> dict[str, Any]:
    from offload_params_deepspeed import run_deepspeed

    ns = argparse.Namespace(
        **{**vars(args), "budget_mib": args.budget_mib / args.world, "min_offload_bytes": None, "buffers": 3}
    )
    out = run_deepspeed(ns, make_model, time_steps)
    out["rank"] = args.rank
    return out


def main() -> None:
    args = parse()
    if args.child:
        run = _deepspeed_child if args.child == "deepspeed" else run_child
        print(json.dumps(run(args)))
        return
    made = args.dir is None
    args.dir = tempfile.mkdtemp(dir=os.getcwd(), prefix="offload-ranks-") if made else args.dir
    modes = args.modes.split(",") + (["deepspeed"] if args.ds_python else [])
    runs: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in modes}
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    load_start = os.getloadavg()
    try:
        for _ in range(args.reps):
            for mode in modes:
                runs[mode].append(spawn(args, mode))
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)
    summary = report(args, runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": " ".join(sys.argv),
                    "started_utc": started,
                    "load_average_start": load_start,
                    "load_average_end": os.getloadavg(),
                    "args": vars(args),
                    "summary": summary,
                    "runs": runs,
                },
                f,
                indent=1,
            )


def report(args: argparse.Namespace, runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """Print medians per mode (over reps, steps and ranks) and the ratios; return them."""
    summary: dict[str, Any] = {}
    for mode, reps in runs.items():
        ranks = [r for rep in reps for r in rep if "error" not in r]
        if not ranks:
            summary[mode] = {"error": reps[0][0].get("error")}
            continue
        row = {
            "step_s": statistics.median(t for r in ranks for t in r["step_s"]),
            "cpu_s": statistics.median(t for r in ranks for t in r["cpu_s"]),
            "io_write_bytes": statistics.median(t for r in ranks for t in r["io_write_bytes"]),
            "rss": max(r["rss"] for r in ranks),
        }
        if "written_per_step" in ranks[0]:
            row.update(
                written_per_step=statistics.median(r["written_per_step"] for r in ranks),
                read_per_step=statistics.median(r["read_per_step"] for r in ranks),
                peak_held=max(r["peak_held"] for r in ranks),
                budget=ranks[0]["budget"],
            )
        summary[mode] = row
    print(
        f"{args.layers} x Linear({args.dim}), AdamW, batch {args.batch} per rank, {args.world} "
        f"gloo ranks, torch threads {args.threads} per process; medians of {args.reps} x "
        f"{args.steps} steps (per rank for the ranks)"
    )
    print(
        f"{'mode':<12}{'step s':>8}{'CPU s':>8}{'written/step GB':>17}{'io write GB':>13}"
        f"{'read/step GB':>14}{'peak RSS MiB':>14}{'held/budget MiB':>17}"
    )
    for mode, row in summary.items():
        if "error" in row:
            print(f"{mode:<12} failed: {row['error']}")
            continue
        held = f"{row['peak_held'] / 2**20:.0f}/{row['budget'] / 2**20:.0f}" if "peak_held" in row else ""
        print(
            f"{mode:<12}{row['step_s']:>8.2f}{row['cpu_s']:>8.2f}"
            f"{row.get('written_per_step', float('nan')) / 1e9:>17.3f}"
            f"{row['io_write_bytes'] / 1e9:>13.3f}{row.get('read_per_step', float('nan')) / 1e9:>14.3f}"
            f"{row['rss'] / 2**20:>14.0f}{held:>17}"
        )
    if "single" in summary and "fsdp" in summary and "error" not in summary["fsdp"]:
        ratio = summary["fsdp"]["written_per_step"] / summary["single"]["written_per_step"]
        summary["written_ratio"] = ratio
        print(f"bytes written per step per rank / single process: {ratio:.3f} (target 0.5)")
    ds = summary.get("deepspeed", {})
    if "fsdp" in summary and "step_s" in ds:
        summary["step_vs_deepspeed"] = summary["fsdp"]["step_s"] / ds["step_s"]
        print(f"step, fsdp + offload / DeepSpeed ZeRO-3: {summary['step_vs_deepspeed']:.2f} (target <= 0.8)")
    return summary


if __name__ == "__main__":
    main()
