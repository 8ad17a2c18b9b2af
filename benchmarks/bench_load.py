"""Loading checkpoints and weights: deepnvme vs the stock readers, side by side (issue 14).

Usage:
  python benchmarks/bench_load.py --dir DIR [--layers 10] [--shards 4] [--reps 5]
         [--cases st,pt,st_dir,pt_dir,into_st,into_pt,into_st_dir,into_pt_dir] [--json OUT]

A transformer-shaped bf16 state dict (``bench_checkpoint.make_state``: hidden 2048, MLP 5632,
vocab 32000; 10 layers is 1.29 GB) is written once as one ``.safetensors`` file, one torch.save
file, and as Hugging Face shard directories (``model-0000i-of-0000N.safetensors`` +
``model.safetensors.index.json``; ``pytorch_model-0000i-of-0000N.bin`` + its index). Then, for
each repetition, every reader of every case runs in a fresh Python process (no allocator or
import state carried over), in a rotated order (no reader always runs first), after
``sync; echo 3 > /proc/sys/vm/drop_caches`` (root; cold reads). Each reader's package is
imported before the clock starts (until 2026-11-25 evening, ``import deepnvme``, about 0.2 s
here, was inside deepnvme's timed region and the peers' imports inside theirs). Each result
is materialised: every page of every tensor is touched inside the timed region (``torch.load(mmap=True)`` is
otherwise lazy). ``into_*`` cases fill an existing, already-touched state dict of the model's
shapes: deepnvme with ``load_into``, the peers with their load followed by ``copy_``
(``into_*_dir``: from the shard directories, deepnvme given the directory, the peers each
shard in turn); the worker reports its peak RSS growth over the target (``VmHWM``).
GB = 1e9 bytes; medians.

Peers: ``safetensors.torch.load_file``, ``torch.load``, ``torch.load(mmap=True)``,
fastsafetensors (``fastsafe_open``, ``nogds=True``) and runai-model-streamer
(``SafetensorsStreamer``); a peer that is not installed is skipped with a note.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ST_FILE, PT_FILE, ST_DIR, PT_DIR = "model.safetensors", "model.pt", "st_shards", "pt_shards"

# case -> (path under --dir, readers); deepnvme first, then the peers. ``deepnvme`` is the
# default call: the load path the device's measured choice names (load_path="auto", chosen
# in the driver before the runs and recorded in the JSON); deepnvme_direct and
# deepnvme_mmap force ``mmap=False`` / ``mmap=True`` (a private mapping populated by
# parallel MADV_POPULATE_READ before returning); for ``into_*``, deepnvme_direct and
# deepnvme_mapped force ``load_path`` and deepnvme_buffered is ``config={"o_direct": False}``.
CASES: dict[str, tuple[str, list[str]]] = {
    "st": (ST_FILE, ["deepnvme", "deepnvme_direct", "deepnvme_mmap", "safetensors", "fastsafetensors",
                     "runai"]),
    "pt": (PT_FILE, ["deepnvme", "deepnvme_direct", "deepnvme_mmap", "torch_load", "torch_mmap"]),
    "st_dir": (ST_DIR, ["deepnvme", "deepnvme_direct", "deepnvme_mmap", "safetensors", "fastsafetensors",
                        "runai"]),
    "pt_dir": (PT_DIR, ["deepnvme", "deepnvme_direct", "deepnvme_mmap", "torch_load", "torch_mmap"]),
    "into_st": (ST_FILE, ["deepnvme", "deepnvme_direct", "deepnvme_mapped", "deepnvme_buffered",
                          "safetensors", "fastsafetensors", "runai"]),
    "into_pt": (PT_FILE, ["deepnvme", "deepnvme_direct", "deepnvme_mapped", "deepnvme_buffered",
                          "torch_load", "torch_mmap"]),
    "into_st_dir": (ST_DIR, ["deepnvme", "deepnvme_direct", "deepnvme_mapped", "deepnvme_buffered",
                             "safetensors", "fastsafetensors", "runai"]),
    "into_pt_dir": (PT_DIR, ["deepnvme", "deepnvme_direct", "deepnvme_mapped", "deepnvme_buffered",
                             "torch_load", "torch_mmap"]),
}
_MMAP = {"deepnvme": None, "deepnvme_direct": False, "deepnvme_mmap": True}
_INTO_CONFIG: dict[str, dict[str, Any] | None] = {
    "deepnvme": None, "deepnvme_direct": {"load_path": "direct"},
    "deepnvme_mapped": {"load_path": "mapped"}, "deepnvme_buffered": {"o_direct": False}}


# ---- worker side: one reader, one case, one process ----------------------------------------

def _touch(tensors: dict[str, torch.Tensor]) -> float:
    total = 0.0
    for t in tensors.values():
        flat = t.reshape(-1)
        step = max(1, 4096 // max(1, t.element_size()))
        total += float(flat[::step].float().sum())
    return total


def _files(path: str, suffix: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(suffix))
    return [path]


def _read_safetensors(path: str, reader: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    files = _files(path, ".safetensors")
    if reader.startswith("deepnvme"):
        import deepnvme
        return deepnvme.load_safetensors(path, mmap=_MMAP[reader])
    if reader == "safetensors":
        from safetensors.torch import load_file
        for f in files:
            out.update(load_file(f))
        return out
    if reader == "fastsafetensors":
        from fastsafetensors import fastsafe_open
        with fastsafe_open(files, nogds=True, device="cpu") as fo:
            for k in fo.keys():
                out[k] = fo.get_tensor(k)
        return out
    if reader == "runai":
        from runai_model_streamer import SafetensorsStreamer
        with SafetensorsStreamer() as streamer:
            for f in files:
                streamer.stream_file(f)
                for name, tensor in streamer.get_tensors():
                    out[name] = tensor.clone()  # the streamer reuses its buffer: keep a copy
        return out
    raise ValueError(reader)


def _read_torch(path: str, reader: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if reader.startswith("deepnvme"):
        import deepnvme
        return deepnvme.load(path, mmap=_MMAP[reader])  # type: ignore[no-any-return]
    for f in _files(path, ".bin") if os.path.isdir(path) else [path]:
        out.update(torch.load(f, weights_only=True, mmap=reader == "torch_mmap"))
    return out


def _read(case: str, path: str, reader: str) -> dict[str, torch.Tensor]:
    return (_read_safetensors if case in ("st", "st_dir", "into_st", "into_st_dir") else _read_torch)(path, reader)


def _model(layers: int) -> dict[str, torch.Tensor]:
    """The benchmark's state dict; ``BENCH_LOAD_TINY=1`` shrinks every dimension (for tests)."""
    from bench_checkpoint import make_state
    if os.environ.get("BENCH_LOAD_TINY") == "1":
        return make_state(layers, hidden=64, mlp=128, vocab=256)
    return make_state(layers)


def _target_like() -> dict[str, torch.Tensor]:
    """An existing model's tensors: same names, shapes and dtypes, every page already touched."""
    return {k: torch.zeros_like(v) for k, v in _model(int(os.environ["BENCH_LOAD_LAYERS"])).items()}


def _hwm() -> int:
    """This process's peak RSS in bytes (VmHWM: per address space, unlike ru_maxrss, which a
    child inherits from the parent that spawned it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


_READER_MODULES = {"safetensors": "safetensors.torch", "fastsafetensors": "fastsafetensors",
                   "runai": "runai_model_streamer"}


def _import_reader(reader: str) -> None:
    """Import the reader's package before the clock starts: a program imports once and loads
    many times, and the packages' import times differ (deepnvme ~0.2 s, safetensors ~3 ms)."""
    module = "deepnvme" if reader.startswith("deepnvme") else _READER_MODULES.get(reader)
    if module is not None:
        importlib.import_module(module)


def run_worker(case: str, path: str, reader: str) -> dict[str, Any]:
    _import_reader(reader)
    target = None
    if case.startswith("into_"):
        target = _target_like()
    base_rss = _hwm()
    t0 = time.perf_counter()
    if target is not None:
        if reader.startswith("deepnvme"):
            import deepnvme
            deepnvme.load_into(target, path, config=_INTO_CONFIG[reader])
        else:
            loaded = _read(case, path, reader)
            for k, v in loaded.items():
                target[k].copy_(v)
            del loaded
        check = _touch(target)
    else:
        tensors = _read(case, path, reader)
        check = _touch(tensors)
    seconds = time.perf_counter() - t0
    peak = _hwm()
    return {"seconds": seconds, "check": check, "peak_rss_growth": peak - base_rss}


# ---- driver side -------------------------------------------------------------------------------

def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _available(reader: str) -> str | None:
    module = {"safetensors": "safetensors", "fastsafetensors": "fastsafetensors",
              "runai": "runai_model_streamer"}.get(reader)
    if module is None:
        return None
    try:
        __import__(module)
    except ImportError as exc:
        return f"{reader} skipped: {exc}"
    return None


def write_inputs(directory: str, layers: int, shards: int, needed: set[str] | None = None) -> int:
    """Write the inputs ``needed`` (names under ``directory``; default all four) once (skipped
    when present); returns the state dict's bytes."""
    from safetensors.torch import save_file
    sd = _model(layers)
    nbytes = sum(t.nbytes for t in sd.values())
    st, pt = os.path.join(directory, ST_FILE), os.path.join(directory, PT_FILE)
    if not os.path.exists(st) and (needed is None or ST_FILE in needed):
        save_file(sd, st)
    if not os.path.exists(pt) and (needed is None or PT_FILE in needed):
        torch.save(sd, pt)
    for sub, prefix, ext, index in ((ST_DIR, "model", "safetensors", "model.safetensors.index.json"),
                                    (PT_DIR, "pytorch_model", "bin", "pytorch_model.bin.index.json")):
        out = os.path.join(directory, sub)
        if os.path.exists(os.path.join(out, index)) or (needed is not None and sub not in needed):
            continue
        os.makedirs(out, exist_ok=True)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(_split(sd, shards)):
            name = f"{prefix}-{i + 1:05d}-of-{shards:05d}.{ext}"
            part = {k: sd[k] for k in names}
            (save_file if ext == "safetensors" else torch.save)(part, os.path.join(out, name))
            weight_map.update({k: name for k in names})
        with open(os.path.join(out, index), "w") as f:
            json.dump({"metadata": {"total_size": nbytes}, "weight_map": weight_map}, f)
    os.sync()
    return nbytes


def _split(sd: dict[str, torch.Tensor], parts: int) -> list[list[str]]:
    total = sum(t.nbytes for t in sd.values())
    out: list[list[str]] = [[]]
    acc = 0
    for k, t in sd.items():
        if acc >= total * len(out) / parts and len(out) < parts:
            out.append([])
        out[-1].append(k)
        acc += t.nbytes
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--readers", default=None, help="only these readers (comma list)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny dimensions (a smoke test of the script)")
    ap.add_argument("--worker", nargs=3, metavar=("CASE", "PATH", "READER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_worker(*args.worker)))
        return 0
    from bench_engine import describe_machine
    os.makedirs(args.dir, exist_ok=True)
    if args.tiny:
        os.environ["BENCH_LOAD_TINY"] = "1"
    cases = [c for c in args.cases.split(",") if c]
    nbytes = write_inputs(args.dir, args.layers, args.shards, {CASES[c][0] for c in cases})
    load_path = _choose_load_path(os.path.join(args.dir, CASES[cases[0]][0]))
    load_start = os.getloadavg()
    only = set(args.readers.split(",")) if args.readers else None
    plan: list[tuple[str, str]] = []
    notes: list[str] = []
    for case in cases:
        for reader in CASES[case][1]:
            if only and reader not in only:
                continue
            why = _available(reader)
            if why:
                notes.append(why)
                continue
            plan.append((case, reader))
    results: dict[str, list[dict[str, Any]]] = {f"{c}/{r}": [] for c, r in plan}
    env = {**os.environ, "BENCH_LOAD_LAYERS": str(args.layers)}
    print(describe_machine(args.dir), f"load average {os.getloadavg()}", file=sys.stderr)
    for rep in range(args.reps):
        for case, reader in (plan[i] for i in _rotated_index(len(plan), rep)):
            _drop_caches()
            path = os.path.join(args.dir, CASES[case][0])
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", case, path, reader],
                                  env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                print(f"{case}/{reader} failed: {proc.stderr[-2000:]}", file=sys.stderr)
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            results[f"{case}/{reader}"].append(res)
            print(f"rep {rep} {case:8s} {reader:16s} {nbytes / res['seconds'] / 1e9:6.2f} GB/s "
                  f"peak+{res['peak_rss_growth'] / 2**20:7.0f} MiB", file=sys.stderr, flush=True)
    table = _table(cases, results, nbytes)
    print(table)
    for n in sorted(set(notes)):
        print(f"note: {n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "layers": args.layers, "load_path": load_path,
                       "load_average_start": load_start, "load_average_end": os.getloadavg(),
                       "shards": args.shards, "reps": args.reps,
                       "dir": args.dir, "machine": describe_machine(args.dir), "notes": sorted(set(notes)),
                       "results": results}, f, indent=1)
    return 0


def _choose_load_path(path: str) -> dict[str, Any]:
    """The device's load-path choice, made here (measured on ``path`` unless cached) so that no
    timed worker measures; the workers read it from the same cache (``DEEPNVME_CACHE_DIR``)."""
    from deepnvme.checkpoint._load_path import load_paths
    from deepnvme.config import checkpoint_config
    file = path if os.path.isfile(path) else max(
        (os.path.join(path, f) for f in os.listdir(path)), key=os.path.getsize)
    choice = load_paths(file, checkpoint_config(None)).to_dict()
    print(f"load path on {choice['device']}: fresh {choice['fresh']}, into {choice['into']} "
          f"({choice['source']}: {choice['reason']})", file=sys.stderr)
    return choice


def _rotated_index(n: int, rep: int) -> list[int]:
    r = (rep * 3) % max(1, n)
    return list(range(r, n)) + list(range(r))


def _table(cases: list[str], results: dict[str, list[dict[str, Any]]], nbytes: int) -> str:
    lines = ["| case | reader | GB/s (median) | s (median) | peak RSS growth MiB | vs best peer |",
             "|---|---|---|---|---|---|"]
    for case in cases:
        rows = {k.split("/", 1)[1]: v for k, v in results.items() if k.startswith(case + "/") and v}
        if not rows:
            continue
        med = {r: {key: statistics.median(x[key] for x in runs) for key in ("seconds", "peak_rss_growth")}
               for r, runs in rows.items()}
        best_peer = min((m["seconds"] for r, m in med.items() if not r.startswith("deepnvme")), default=None)
        for r, m in med.items():
            s = m["seconds"]
            ratio = f"{best_peer / s:.2f}x" if best_peer and r.startswith("deepnvme") else ""
            lines.append(f"| {case} | {r} | {nbytes / s / 1e9:.2f} | {s:.3f} | "
                         f"{m['peak_rss_growth'] / 2**20:.0f} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
