"""Parameter + gradient + optimizer-state offload: step time vs the I/O roofline, and peak RSS.

A stack of ``--layers`` Linear(dim, dim) + ReLU layers is trained with AdamW (a) in memory and
(b) built on the meta device into ``offload_parameters`` (parameters and gradients in files,
``--budget-mib`` of memory for them) with ``NVMeOptimizer`` (Adam state in files). Each mode runs
in its own subprocess so its peak RSS (VmHWM, above the RSS after importing torch) is its own;
the two alternate over ``--reps`` repetitions; the peak is that of the timed steps (VmHWM is
reset after the first step, which creates the optimizer state; its own peak is printed too).
The storage's bandwidth is measured in the same run (benchmarks/offload_bench.py: O_DIRECT,
cold reads, writes through fsync, and one file read while another is written). Roofline of an
offloaded step = max(bytes read + written per step / the concurrent rate, in-memory step time).
Heap note: the figures are with glibc's default malloc settings. GB = 1e9 bytes.

    flock /tmp/bench.lock python benchmarks/bench_offload_params.py --dir /mnt/nvme/x --json out.json
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
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from offload_bench import measure_bandwidth, status  # noqa: E402  (same folder)

import deepnvme  # noqa: E402


def make_model(layers: int, dim: int) -> torch.nn.Sequential:
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(dim, dim), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def init(name: str, t: torch.Tensor) -> None:
    """He init (activations keep their scale through the ReLU stack: no denormals), zero biases."""
    t.normal_(0.0, (2.0 / t.shape[1]) ** 0.5) if t.dim() > 1 else t.zero_()


def time_steps(
    step: Callable[[], None], steps: int, baseline: int, *, on_first_timed: Callable[[], None] | None = None
) -> dict:
    """Run ``step`` ``steps`` + 1 times: the first (it creates the optimizer state and learns
    the order) untimed, VmHWM reset after it; wall time, CPU seconds of the process (all
    threads) and minor faults of each timed step, and the peaks above ``baseline``."""
    times, cpu, faults = [], [], []
    first_peak = 0
    for i in range(steps + 1):
        if i == 1 and on_first_timed is not None:
            on_first_timed()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        step()
        if i > 0:
            times.append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
            faults.append(r1.ru_minflt - r0.ru_minflt)
        else:
            first_peak = status("VmHWM") - baseline
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM: the timed steps' own peak from here on
    return {
        "step_s": times,
        "cpu_s": cpu,
        "minor_faults": faults,
        "rss": status("VmHWM") - baseline,
        "rss_first_step": first_peak,
    }


def run_mode(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warm = torch.nn.Linear(64, 64)  # page in autograd and the optimizer before the baseline
    torch.optim.AdamW(warm.parameters()).step(warm(torch.randn(8, 64)).sum().backward())
    baseline = status("VmRSS")
    config = deepnvme.IOConfig(block_size=args.block_size, intra_op_parallelism=args.io_threads)
    budget = int(args.budget_mib * 2**20)
    offload = None
    if args.mode == "memory":
        model = make_model(args.layers, args.dim)
        with torch.no_grad():
            for name, p in model.named_parameters():
                init(name, p)
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        with torch.device("meta"):
            model = make_model(args.layers, args.dim)
        offload = deepnvme.offload_parameters(
            model,
            args.dir,
            max_in_memory_bytes=budget,
            prefetch=args.prefetch,
            config=config,
            source=init,
            min_offload_bytes=args.min_offload_bytes,
            offload_gradients=not args.keep_gradients,
        )
        opt = deepnvme.NVMeOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            swap_dir=args.dir,
            config=config,
            buffer_count=args.buffers,
            lr=1e-4,
            update_threads=("auto" if args.update_threads is None else args.update_threads),
            fuse_backward={"auto": "auto", "0": False, "1": True}[args.fuse_backward],
        )
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(1))

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    out = {
        "mode": args.mode,
        "n_params": sum(p.numel() for p in model.parameters()),
        **time_steps(step, args.steps, baseline, on_first_timed=offload.reset_stats if offload is not None else None),
    }
    if isinstance(opt, deepnvme.NVMeOptimizer) and offload is not None:
        s = offload.stats()
        state = opt.swapped_bytes
        out.update(
            read_per_step=s.bytes_read / args.steps + state,
            written_per_step=s.bytes_written / args.steps + state,
            state_bytes=state,
            peak_held=s.peak_bytes,
            budget=budget,
            sub_groups=opt.num_sub_groups,
            opt_buffers=args.buffers * opt.buffer_bytes,
            prefetch_hits=s.prefetch_hits / args.steps,
            buffers_reused=s.buffers_reused / args.steps,
        )
        offload.close()
        opt.close()
    return out


def spawn(args: argparse.Namespace, mode: str) -> dict:
    python = args.ds_python if mode == "deepspeed" else sys.executable
    cmd = [python, __file__, "--child", mode, "--dir", args.dir]
    for k in (
        "layers",
        "dim",
        "batch",
        "budget_mib",
        "steps",
        "buffers",
        "prefetch",
        "block_size",
        "io_threads",
        "threads",
        "min_offload_bytes",
        "update_threads",
        "keep_gradients",
    ):
        if getattr(args, k) is not None:
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    env = None
    if mode == "deepspeed":  # the side venv's bin and torch extensions (its prebuilt ops)
        from bench_offload_gpt import ds_env

        env = ds_env(python)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if mode == "deepspeed":  # its swap files stay behind; the next runs need the space
        shutil.rmtree(os.path.join(args.dir, "deepspeed"), ignore_errors=True)
    if proc.returncode and mode == "deepspeed":  # the peer's failure is a result, not the end
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        return {"mode": mode, "error": lines[-1] if lines else f"exit {proc.returncode}"}
    if proc.returncode:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the storage to test (default: a temp dir in cwd)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=2048, help="each layer has dim x dim + dim fp32 parameters")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--budget-mib", type=float, default=64.0, help="max_in_memory_bytes, MiB")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up)")
    ap.add_argument("--reps", type=int, default=2, help="alternating repetitions of each mode")
    ap.add_argument("--buffers", type=int, default=3, help="NVMeOptimizer buffer_count")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8 << 20)
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    ap.add_argument(
        "--min-offload-bytes",
        type=int,
        default=None,
        help="offload_parameters' min_offload_bytes (default: the library's, 64 KiB); "
        "the DeepSpeed peer keeps the same parameters in memory "
        "(stage3_param_persistence_threshold, model cap = budget / 8)",
    )
    ap.add_argument(
        "--update-threads",
        type=int,
        default=None,
        help="NVMeOptimizer's update_threads (torch threads for AdamW's update while "
        'the I/O runs; default: the library\'s "auto")',
    )
    ap.add_argument(
        "--keep-gradients",
        type=int,
        choices=[0, 1],
        default=0,
        help="1: offload_parameters(offload_gradients=False), gradients kept in memory "
        "as DeepSpeed's ZeRO-3 keeps them",
    )
    ap.add_argument("--fuse-backward", choices=("auto", "0", "1"), default="auto",
                    help="NVMeOptimizer(fuse_backward=): the update in the backward pass (default auto)")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--report", help="only print the table of a --json file written earlier")
    ap.add_argument(
        "--ds-python", default=None, help="python of a side environment with DeepSpeed: adds the ZeRO-3 NVMe peer"
    )
    ap.add_argument("--child", choices=["memory", "offload", "deepspeed"], default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse()
    if args.report:  # print the table of an earlier run's --json file
        with open(args.report) as f:
            saved = json.load(f)
        bw = saved["bandwidth_GBps"]
        args = argparse.Namespace(**{**vars(args), **saved["args"], "json": None})
        report(args, saved["runs"], bw["write"], bw["read"], bw["concurrent"])
        return
    if args.child:
        args.mode = args.child
        if args.child == "deepspeed":
            from offload_params_deepspeed import run_deepspeed

            print(json.dumps(run_deepspeed(args, make_model, time_steps)))
        else:
            print(json.dumps(run_mode(args)))
        return
    made = args.dir is None
    args.dir = tempfile.mkdtemp(dir=os.getcwd(), prefix="offload-params-") if made else args.dir
    try:
        runs: dict[str, list[dict]] = {"memory": [], "offload": []}
        if args.ds_python:
            runs["deepspeed"] = []
        for _ in range(args.reps):
            for mode in runs:
                runs[mode].append(spawn(args, mode))
        off = runs["offload"][0]
        bw_args = argparse.Namespace(
            block_size=args.block_size, io_threads=args.io_threads, reps=args.reps, dir=args.dir
        )
        w_bw, r_bw, m_bw = measure_bandwidth(bw_args, min(int(off["read_per_step"]), 1 << 30))
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)
    report(args, runs, w_bw, r_bw, m_bw)


def report(args: argparse.Namespace, runs: dict[str, list[dict]], w_bw: float, r_bw: float, m_bw: float) -> None:
    mem_t = statistics.median(t for r in runs["memory"] for t in r["step_s"])
    off_t = statistics.median(t for r in runs["offload"] for t in r["step_s"])
    off = runs["offload"][0]
    rd, wr = off["read_per_step"], off["written_per_step"]
    io_t = (rd + wr) / (m_bw * 1e9)
    roof = max(io_t, mem_t)
    stored = 2 * 4 * off["n_params"] + off["state_bytes"]  # parameters, gradients, state
    rss = max(r["rss"] for r in runs["offload"])
    bound = off["budget"] + off["opt_buffers"]
    print(
        f"{args.layers} x Linear({args.dim}, {args.dim}), {off['n_params'] / 1e6:.0f} M fp32 params, "
        f"AdamW, batch {args.batch}; torch threads {args.threads}, I/O threads {args.io_threads}, "
        f"block {args.block_size >> 10} KiB, prefetch {args.prefetch}, update threads "
        f"{getattr(args, 'update_threads', None) or 'auto'}; medians of "
        f"{args.reps} x {args.steps} steps"
    )
    print(
        f"storage ({args.dir}): write {w_bw:.2f} GB/s (through fsync), cold read {r_bw:.2f} "
        f"GB/s, concurrent read+write {m_bw:.2f} GB/s"
    )
    print(
        f"per offloaded step: read {rd / 1e9:.2f} GB, written {wr / 1e9:.2f} GB -> I/O "
        f"roofline {io_t:.2f} s; in-memory step {mem_t:.2f} s; roofline {roof:.2f} s"
    )
    print()
    print(f"{'':<34}{'value':>12}{'target':>14}{'ratio':>9}")
    print(f"{'step time, offloaded (s)':<34}{off_t:>12.2f}{'<= 1.3 x roof':>14}{off_t / roof:>9.2f}")
    print(f"{'stored / budget (params+grads+state)':<34}{stored / off['budget']:>12.1f}{'>= 3':>14}{'':>9}")
    print(
        f"{'peak RSS above baseline (MiB)':<34}{rss / 2**20:>12.0f}"
        f"{f'<= {1.1 * bound / 2**20:.0f}':>14}{rss / bound:>9.2f}"
    )
    print(f"{'  budget + optimizer buffers (MiB)':<34}{bound / 2**20:>12.0f}")
    print(f"{'  held params+grads at peak (MiB)':<34}{off['peak_held'] / 2**20:>12.0f}")
    if "buffers_reused" in off:
        print(f"{'  buffers reused per step':<34}{off['buffers_reused']:>12.0f}")
    print(f"{'  first step (creates the state)':<34}{max(r['rss_first_step'] for r in runs['offload']) / 2**20:>12.0f}")
    mem_rss = max(r["rss"] for r in runs["memory"])
    # the loop's own memory (activations, autograd's temporaries, AdamW's temporaries): the
    # in-memory run's peak less its parameters, gradients and Adam state (4 + 4 + 8 B/param)
    loop = max(mem_rss - 16 * off["n_params"], 0)
    print(f"{'peak RSS in memory (MiB)':<34}{mem_rss / 2**20:>12.0f}")
    print(f"{'  loop own = that - 16 B/param':<34}{loop / 2**20:>12.0f}")
    print(
        f"{'offload share = peak - loop own':<34}{(rss - loop) / 2**20:>12.0f}"
        f"{f'<= {1.1 * bound / 2**20:.0f}':>14}{(rss - loop) / bound:>9.2f}"
    )
    print(f"{'offloaded RSS / (bound + loop own)':<34}{'':>12}{'<= 1.1':>14}{rss / (bound + loop):>9.2f}")
    if "cpu_s" in off:  # CPU seconds of the whole process per step (I/O threads included)
        for mode in ("memory", "offload"):
            c = statistics.median(t for r in runs[mode] for t in r["cpu_s"])
            f = statistics.median(t for r in runs[mode] for t in r["minor_faults"])
            print(f"{f'CPU s / minor faults per step, {mode}':<34}{c:>12.2f}{f:>14.0f}")
    failed = [r["error"] for r in runs.get("deepspeed", []) if "error" in r]
    if failed:
        print(f"DeepSpeed ZeRO-3 failed: {failed[0]}")
    elif runs.get("deepspeed"):
        ds_t = statistics.median(t for r in runs["deepspeed"] for t in r["step_s"])
        ds_rss = max(r["rss"] for r in runs["deepspeed"])
        print(f"{'DeepSpeed ZeRO-3 step (s)':<34}{ds_t:>12.2f}{'<= 0.8x':>14}{off_t / ds_t:>9.2f}")
        print(f"{'DeepSpeed ZeRO-3 peak RSS (MiB)':<34}{ds_rss / 2**20:>12.0f}{'>= 1x ours':>14}{rss / ds_rss:>9.2f}")
        c = statistics.median(t for r in runs["deepspeed"] for t in r["cpu_s"])
        print(f"{'CPU s per step, deepspeed':<34}{c:>12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": {k: v for k, v in vars(args).items() if k not in ("child", "report")},
                    "runs": runs,
                    "bandwidth_GBps": {"write": w_bw, "read": r_bw, "concurrent": m_bw},
                    "step_s": {"memory": mem_t, "offload": off_t},
                    "roofline_s": roof,
                    "io_roofline_s": io_t,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
