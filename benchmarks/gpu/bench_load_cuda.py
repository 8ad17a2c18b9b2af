"""Loads straight to a CUDA device: deepnvme vs safetensors and fastsafetensors (with and without GDS).

Usage (on a CUDA machine, as root for cold reads):
    python benchmarks/gpu/bench_load_cuda.py --dir DIR [--gb 2] [--reps 3] [--json OUT]

One bf16 state dict of about ``--gb`` GB (transformer-shaped tensors of 8-64 MiB) is written once
as ``model.safetensors`` and as a torch.save ``model.pt``. Each repetition runs every reader in a
fresh Python process (CUDA initialised and the reader imported before the clock starts), in a
rotated order, after ``sync; echo 3 > /proc/sys/vm/drop_caches`` (cold). The clock stops after
``torch.cuda.synchronize()`` once every tensor is on the device. After the clock each worker
compares every tensor with the file's CPU values (bitwise) and reports ``equal``.
GB = 1e9 bytes; medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

READERS = ["deepnvme", "deepnvme_staged", "deepnvme_into", "safetensors", "fastsafetensors",
           "fastsafetensors_gds"]
#: also available with --readers: the torch.save file read by deepnvme.load and torch.load
MORE_READERS = ["deepnvme_pt", "torch_pt"]


def _state(gb: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    total, i = 0, 0
    while total < gb * 1e9:
        rows = (4096, 8192, 11008)[i % 3]
        t = torch.randn(rows, 4096, generator=g).to(torch.bfloat16)
        out[f"layers.{i}.weight"] = t
        total += t.nbytes
        i += 1
    return out


def _read(reader: str, d: str) -> dict[str, torch.Tensor]:
    st, pt = os.path.join(d, "model.safetensors"), os.path.join(d, "model.pt")
    if reader in ("deepnvme", "deepnvme_staged"):
        import deepnvme
        from deepnvme.checkpoint import _fill_plan
        # the other route for contiguous CUDA targets: one staging-pipeline request per tensor
        _fill_plan.CUDA_ROUTE = "staged" if reader == "deepnvme_staged" else "bounce"
        return deepnvme.load_safetensors(st, device="cuda")
    if reader == "deepnvme_into":
        import deepnvme
        target = _targets(d)
        torch.cuda.synchronize()
        deepnvme.load_into(target, st)
        return target
    if reader == "deepnvme_pt":
        import deepnvme
        return deepnvme.load(pt, map_location="cuda")  # type: ignore[no-any-return]
    if reader == "safetensors":
        from safetensors.torch import load_file
        return load_file(st, device="cuda")
    if reader == "torch_pt":
        return torch.load(pt, map_location="cuda", weights_only=True)  # type: ignore[no-any-return]
    if reader.startswith("fastsafetensors"):
        from fastsafetensors import fastsafe_open
        out = {}
        with fastsafe_open([st], nogds=not reader.endswith("_gds"), device="cuda:0") as fo:
            for k in fo.keys():
                out[k] = fo.get_tensor(k).clone()  # the reader frees its buffer at close
        return out
    raise ValueError(reader)


_TARGETS: dict[str, torch.Tensor] = {}


def _targets(d: str) -> dict[str, torch.Tensor]:
    return _TARGETS


def worker(reader: str, d: str) -> dict[str, Any]:
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    if reader.startswith("deepnvme"):
        import deepnvme  # noqa: F401
    elif reader.startswith("fastsafetensors"):
        import fastsafetensors  # noqa: F401
    elif reader == "safetensors":
        import safetensors.torch  # noqa: F401
    if reader == "deepnvme_into":
        from safetensors import safe_open
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                _TARGETS[k] = torch.empty(sl.get_shape(), dtype=torch.bfloat16, device="cuda")
        _drop()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = _read(reader, d)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    from safetensors.torch import load_file
    ref = load_file(os.path.join(d, "model.safetensors"))
    equal = set(ref) == set(out) and all(
        out[k].device.type == "cuda" and torch.equal(out[k].cpu().view(torch.int16), ref[k].view(torch.int16))
        for k in ref)
    return {"reader": reader, "seconds": seconds, "equal": equal}


def _drop() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        print(f"cannot drop caches: {exc}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".")
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--readers", default=",".join(READERS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    os.makedirs(args.dir, exist_ok=True)
    state = _state(args.gb)
    nbytes = sum(t.nbytes for t in state.values())
    import deepnvme
    deepnvme.save_safetensors(state, os.path.join(args.dir, "model.safetensors"))
    torch.save(state, os.path.join(args.dir, "model.pt"))
    del state
    readers = args.readers.split(",")
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in readers}
    for rep in range(args.reps):
        order = readers[rep % len(readers):] + readers[:rep % len(readers)]
        for reader in order:
            _drop()
            proc = subprocess.run([sys.executable, __file__, "--dir", args.dir, "--worker", reader, args.dir],
                                  capture_output=True, text=True, timeout=180)
            if proc.returncode != 0:
                runs[reader].append({"error": proc.stderr.strip().splitlines()[-3:]})
            else:
                runs[reader].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"rep {rep} {reader}: {runs[reader][-1]}", flush=True)
        _report(args, runs, nbytes)
    return 0


def _report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], nbytes: int) -> None:
    rows = []
    for reader, rs in runs.items():
        ok = [r for r in rs if "seconds" in r]
        med = statistics.median(r["seconds"] for r in ok) if ok else None
        rows.append({"reader": reader, "median_s": med, "gb_per_s": nbytes / med / 1e9 if med else None,
                     "equal": all(r["equal"] for r in ok) if ok else None, "runs": rs})
    result = {"machine": f"{platform.node()} {torch.cuda.get_device_name()} torch {torch.__version__}",
              "bytes": nbytes, "reps": args.reps, "command": " ".join(sys.argv), "rows": rows}
    for r in rows:
        print(f"{r['reader']:22s} {r['median_s'] or 0:8.3f} s {r['gb_per_s'] or 0:7.2f} GB/s equal={r['equal']}"
              + ("" if r["median_s"] else f" {r['runs'][0]}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
