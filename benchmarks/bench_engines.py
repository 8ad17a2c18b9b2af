"""deepnvme's I/O engines vs DeepSpeed's aio_handle vs fio, side by side in one run (issue 12).

Usage:
  python benchmarks/bench_engines.py --dir DIR [--size 1G] [--reps 5] [--parallelism 1,2,4]
      [--engines io_uring,aio,threads] [--block-size 1M] [--queue-depth 32] [--rand-ios 65536]
      [--ds-python /work/venv-peers/bin/python] [--no-fio] [--no-randread] [--no-new-file]
      [--reuse N] [--json out.json]

Measured, per tool, at the same block size, queue depth and intra_op_parallelism:
  * a sequential write of --size bytes from a page-locked buffer, timed until the data is on
    stable storage (deepnvme: submit_write(fsync=True); DeepSpeed: sync_pwrite then os.fsync of
    the file, both inside the timed region; fio: --end_fsync=1, which its runtime includes);
  * the same write into a new file (the file deleted first, so every write extends it, as a
    checkpoint's does; fio: --file_append=1 on the missing file, no layout), unless --no-new-file;
  * a cold sequential read of the same bytes (O_DIRECT for all three; page cache also dropped
    with posix_fadvise(DONTNEED) before every read);
  * 4 KiB reads at --rand-ios random 4096-aligned offsets over the file, queue depth 32, one
    worker (deepnvme: handle.read_many; DeepSpeed: one async_pread per read, then wait();
    fio: randread, libaio, iodepth 32, numjobs 1, number_ios, norandommap);
  * CPU seconds (user + sys) of the process doing the I/O per GB moved: getrusage(RUSAGE_SELF)
    deltas around the timed region inside the worker, fio's usr_cpu/sys_cpu x its job runtime.

Every measurement runs in a fresh process (benchmarks/bench_engines_worker.py, printing one JSON
line): deepnvme with this python, DeepSpeed with --ds-python (benchmarks/setup_peers.sh builds
one), fio as itself, so all pay the same process model; buffer allocation and filling stay
outside the timed region. With --reuse N a sample is N transfers of one buffer after an untimed
warm-up (a training job's reused swap and staging buffers: deepnvme's io_uring registers the
buffer once instead of the kernel pinning its pages per request); fio, whose buffers are
always reused, runs as without it. Before it, a probe writes and reads 1 MiB with each deepnvme engine
and with DeepSpeed: an engine this system cannot run, or a DeepSpeed that does not load, is left
out with a note.
The overwrite rewrites one file in --dir in place (same size, no truncation), so every tool
reads back the blocks some tool wrote. Rounds interleave the tools and rotate their order.
fio runs one job (no intra_op_parallelism), so its row stands beside every parallelism.
Results: medians over --reps [min-max]; GB = 1e9 bytes; ratios of medians are printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
from typing import Any

from _engines_report import FIO_RAND, FIO_SEQ, RAND_QUEUE_DEPTH, Samples, report
from bench_engines_worker import RAND_BLOCK, RESULT_TAG

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_engines_worker.py")
SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'1G' -> 1073741824 (binary suffixes K, M, G, T; an optional trailing 'iB' or 'B')."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in SUFFIXES else ""
    return int(t[: len(t) - len(unit)]) * SUFFIXES[unit]


class WorkerFailed(RuntimeError):
    pass


def spawn(python: str, spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run bench_engines_worker.py with ``python``; its result, or WorkerFailed with its last words."""
    try:
        proc = subprocess.run([python, WORKER, json.dumps(spec)], capture_output=True, text=True,
                              timeout=900, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        raise WorkerFailed(f"{spec['tool']} {spec['op']} worker ran past {exc.timeout} s") from None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG) and proc.returncode == 0:
            return dict(json.loads(line[len(RESULT_TAG):]))
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise WorkerFailed(f"{spec['tool']} {spec['op']} worker exited {proc.returncode}: {tail}")


def run_fio(path: str, op: str, args: argparse.Namespace) -> dict[str, Any]:
    """fio's own runtime (end_fsync included for writes) and CPU (usr%, sys% of its job runtime)."""
    cmd = ["fio", "--name=bench", f"--filename={path}", f"--size={args.size}", "--ioengine=libaio",
           "--direct=1", "--numjobs=1", "--output-format=json"]
    if op == "write_new":
        cmd += ["--rw=write", f"--bs={args.block_size}", f"--iodepth={args.queue_depth}",
                "--end_fsync=1", "--file_append=1", "--fallocate=none"]
    elif op == "randread":
        cmd += ["--rw=randread", f"--bs={RAND_BLOCK}", f"--iodepth={RAND_QUEUE_DEPTH}",
                f"--number_ios={args.rand_ios}", "--norandommap", "--randrepeat=0"]
    else:
        cmd += [f"--rw={op}", f"--bs={args.block_size}", f"--iodepth={args.queue_depth}"]
        cmd += ["--end_fsync=1"] if op == "write" else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise WorkerFailed(f"fio {op} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    side = job["read" if op in ("read", "randread") else "write"]
    seconds = side["runtime"] / 1e3
    if seconds <= 0:
        raise WorkerFailed(f"fio {op} finished within its 1 ms clock: use a larger --size/--rand-ios")
    cpu = job["job_runtime"] / 1e3 / 100
    return {"seconds": seconds, "bytes": int(side["io_bytes"]), "cpu_user": job["usr_cpu"] * cpu,
            "cpu_sys": job["sys_cpu"] * cpu, "engine": "libaio"}


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def preallocate(path: str, size: int) -> None:
    """Write real data over the whole file (an fallocated extent reads as zeros without I/O)."""
    chunk = random.Random(7).randbytes(min(size, 8 << 20))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, size, len(chunk)):
            os.pwrite(fd, chunk[: size - off], off)
        os.fsync(fd)
    finally:
        os.close(fd)


def check_direct(directory: str, probe_path: str) -> None:
    try:
        os.close(os.open(probe_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644))
    except OSError as exc:
        sys.exit(f"{directory} does not take O_DIRECT ({exc}), so reads could not be cold: "
                 "choose another --dir")


def describe_machine(directory: str) -> dict[str, str]:
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mount = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "-T", directory],
                           capture_output=True, text=True, check=False).stdout.split() + ["?", "?"]
    fio = (subprocess.run(["fio", "--version"], capture_output=True, text=True, check=False).stdout.strip()
           if shutil.which("fio") else "no fio")
    return {"cpu": f"{cpu}, {os.cpu_count()} logical CPUs, {mem / 2**30:.0f} GiB RAM",
            "kernel": f"Linux {platform.release()}",
            "dir": f"{os.path.abspath(directory)} on {mount[0]} ({mount[1]}{describe_device(mount[0])})",
            "software": f"Python {platform.python_version()}, {fio}"}


def describe_device(source: str) -> str:
    """'; disk 256G, rotational 1, mq-deadline[, model M][, backed by FILE]' from lsblk/losetup."""
    if not source.startswith("/dev/") or not shutil.which("lsblk"):
        return ""
    fields = subprocess.run(["lsblk", "-ndo", "TYPE,SIZE,ROTA,SCHED,MODEL", source], capture_output=True,
                            text=True, check=False).stdout.split(None, 4)
    if len(fields) < 4:
        return ""
    text = f"; {fields[0]} {fields[1]}, rotational {fields[2]}, scheduler {fields[3]}"
    text += f", model {fields[4].strip()}" if len(fields) > 4 and fields[4].strip() else ""
    if fields[0] == "loop":
        backing = subprocess.run(["losetup", "-nO", "BACK-FILE", source], capture_output=True,
                                 text=True, check=False).stdout.strip()
        text += f", backed by {backing}" if backing else ""
    return text


def probe_deepnvme(requested: list[str], probe_path: str, notes: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The requested engines that this deepnvme and this system run (a note for each one left out),
    and what the default handle offers. A deepnvme that cannot move 1 MiB at all is an error."""
    base = {"tool": "deepnvme", "op": "probe", "path": probe_path, "block_size": 1 << 20,
            "queue_depth": 4, "parallelism": 1}
    offers = spawn(sys.executable, {**base, "engine": None})
    if not offers["engine_param"]:
        notes.append("this deepnvme.AioHandle takes no engine= yet: measuring its thread engine "
                     f"only (asked for {','.join(requested)})")
        return ["threads"], offers
    engines = []
    for name in requested:
        try:
            got = spawn(sys.executable, {**base, "engine": name})["engine"]
        except WorkerFailed as exc:
            notes.append(f"deepnvme engine {name!r} left out: {exc}")
            continue
        if name not in ("auto", got):
            notes.append(f"deepnvme engine {name!r} left out: the handle ran {got!r}")
            continue
        if name == "auto":
            notes.append(f"deepnvme engine 'auto' runs {got!r} here")
        engines.append(name)
    return engines, offers


def probe_deepspeed(ds_python: str | None, probe_path: str, notes: list[str]) -> dict[str, Any] | None:
    """What ``ds_python``'s DeepSpeed offers when its async_io op loads and moves 1 MiB, else None
    with a note: the DeepSpeed column is then left out."""
    if not ds_python:
        notes.append("DeepSpeed column skipped: no --ds-python (benchmarks/setup_peers.sh builds "
                     "a side venv with DeepSpeed)")
        return None
    if not os.access(ds_python, os.X_OK):
        notes.append(f"DeepSpeed column skipped: --ds-python {ds_python} is not an executable")
        return None
    spec = {"tool": "deepspeed", "op": "probe", "path": probe_path, "block_size": 1 << 20,
            "queue_depth": 4, "parallelism": 1}
    try:
        return spawn(ds_python, spec, env=ds_env(ds_python))
    except WorkerFailed as exc:
        notes.append(f"DeepSpeed column skipped: its async_io op does not load or run ({exc})")
        return None


def ds_env(ds_python: str) -> dict[str, str]:
    """Environment of a DeepSpeed worker: the side venv's bin first on PATH (its ninja) and the
    venv's own torch extension directory, where setup_peers.sh built async_io; a different ninja
    or directory would recompile the op (minutes, outside the timed region but on the same CPUs)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bindir = os.path.dirname(os.path.abspath(ds_python))
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    ext_dir = os.path.join(os.path.dirname(bindir), "torch_extensions")
    if "TORCH_EXTENSIONS_DIR" not in env and os.path.isdir(ext_dir):
        env["TORCH_EXTENSIONS_DIR"] = ext_dir
    return env


def plan(args: argparse.Namespace, engines: list[str], ds: bool, fio: bool) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, kind, spec) for every measurement of one round; kind 'seq' = write then read."""
    base = {"block_size": args.block_size, "queue_depth": args.queue_depth}
    items: list[tuple[str, str, dict[str, Any]]] = []
    for p in args.parallelism:
        for e in engines:
            items.append((f"deepnvme {e} p{p}", "seq", {**base, "tool": "deepnvme", "engine": e,
                                                         "parallelism": p}))
        if ds:
            items.append((f"DeepSpeed aio p{p}", "seq", {**base, "tool": "deepspeed", "parallelism": p}))
    if fio:
        items.append((FIO_SEQ, "seq", {"tool": "fio"}))
    if args.rand_ios:
        rand = {"block_size": RAND_BLOCK, "queue_depth": RAND_QUEUE_DEPTH, "parallelism": 1}
        for e in engines:
            items.append((f"deepnvme {e}", "randread", {**rand, "tool": "deepnvme", "engine": e}))
        if ds:
            items.append(("DeepSpeed aio", "randread", {**rand, "tool": "deepspeed"}))
        if fio:
            items.append((FIO_RAND, "randread", {"tool": "fio"}))
    return items


def measure(op: str, spec: dict[str, Any], args: argparse.Namespace, path: str, seed: int) -> dict[str, Any]:
    """One sample; reads start with the file's pages dropped from the page cache."""
    spec = {**spec, "op": op, "path": path, "size": args.size, "file_size": args.size,
            "ios": args.rand_ios, "seed": seed, "reuse": args.reuse}
    if op == "write_new":
        os.unlink(path)
    elif op != "write":
        evict(path)
    if spec["tool"] == "fio":
        return run_fio(path, op, args)
    if spec["tool"] == "deepspeed":
        return spawn(args.ds_python, spec, env=ds_env(args.ds_python))
    return spawn(sys.executable, spec)


def run_rounds(args: argparse.Namespace, items: list[tuple[str, str, dict[str, Any]]], path: str,
               notes: list[str]) -> Samples:
    """Every item once per round, the order rotated by one each round. A DeepSpeed failure drops
    that DeepSpeed row (its label) with a note, keeping the others; a deepnvme or fio failure
    stops the run."""
    results: Samples = {}
    dropped: set[str] = set()
    for rnd in range(args.reps):
        shift = rnd % len(items)
        for label, kind, spec in items[shift:] + items[:shift]:
            if label in dropped:
                continue
            seq = ("write_new", "write", "read") if args.new_file else ("write", "read")
            for op in seq if kind == "seq" else ("randread",):
                try:
                    sample = measure(op, spec, args, path, seed=rnd)
                except WorkerFailed as exc:
                    if spec["tool"] != "deepspeed":
                        raise
                    notes.append(f"{label} dropped in round {rnd + 1}: {exc}")
                    dropped.add(label)
                    break
                results.setdefault(label, {}).setdefault(op, []).append(sample)
        print(f"round {rnd + 1}/{args.reps} done", file=sys.stderr, flush=True)
    for label in dropped:
        results.pop(label, None)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".", help="directory of the benchmark file (default: .)")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"), help="bytes per sequential op")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--parallelism", default="1,2,4", help="intra_op_parallelism values (default 1,2,4)")
    ap.add_argument("--engines", default="io_uring,aio,threads", help="deepnvme engines to measure")
    ap.add_argument("--block-size", type=parse_size, default=parse_size("1M"))
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--rand-ios", type=int, default=65536, help="4 KiB random reads per sample")
    ap.add_argument("--no-randread", action="store_true", help="leave out the random reads")
    ap.add_argument("--ds-python", help="python of a venv with DeepSpeed (benchmarks/setup_peers.sh)")
    ap.add_argument("--no-fio", action="store_true", help="leave out fio")
    ap.add_argument("--no-new-file", dest="new_file", action="store_false",
                    help="leave out the writes into a new file")
    ap.add_argument("--reuse", type=int, default=0, metavar="N",
                    help="per sample, one untimed transfer of the buffer, then N timed ones of the "
                         "same buffer (default 0: one timed transfer, the process's first)")
    ap.add_argument("--json", help="write the machine, notes, medians and every sample here")
    args = ap.parse_args(argv)
    args.parallelism = [int(p) for p in args.parallelism.split(",") if p.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.no_randread:
        args.rand_ios = 0
    if args.size <= 0 or args.size % RAND_BLOCK or args.block_size <= 0 or args.block_size % RAND_BLOCK:
        ap.error("--size and --block-size must be positive multiples of 4096 (O_DIRECT)")
    if args.reuse < 0:
        ap.error("--reuse must be >= 0")
    if args.reps < 1 or args.queue_depth < 1 or min(args.parallelism, default=0) < 1 or args.rand_ios < 0:
        ap.error("--reps, --queue-depth and --parallelism must be >= 1, --rand-ios >= 0")
    if not args.engines:
        ap.error("--engines names no engine")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    directory = os.path.abspath(args.dir)
    path = os.path.join(directory, f".bench-engines-{os.getpid()}.bin")
    probe_path = path + ".probe"
    notes: list[str] = []
    machine = describe_machine(directory)
    try:
        check_direct(directory, probe_path)
        engines, offers = probe_deepnvme(args.engines, probe_path, notes)
        machine["software"] += f", torch {offers['torch']}, deepnvme {offers['version']}"
        if args.rand_ios and not offers["read_many"]:
            notes.append("this deepnvme.AioHandle has no read_many yet: its random reads are one "
                         "submit_read per 4 KiB (all submitted, then awaited)")
        ds = probe_deepspeed(args.ds_python, probe_path, notes)
        if ds:
            machine["software"] += f", DeepSpeed {ds['version']} (torch {ds['torch']}, {args.ds_python})"
        fio = not args.no_fio and shutil.which("fio") is not None
        if not args.no_fio and not fio:
            notes.append("fio rows skipped: no fio on PATH (apt-get install fio)")
        if not engines:
            sys.exit("none of the requested deepnvme engines runs here:\n" + "\n".join(notes))
        preallocate(path, args.size)
        results = run_rounds(args, plan(args, engines, ds is not None, fio), path, notes)
    finally:
        for p in (path, probe_path):
            if os.path.exists(p):
                os.unlink(p)
    med = report(args, machine, notes, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "notes": notes, "args": vars(args), "medians": med,
                       "samples": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
