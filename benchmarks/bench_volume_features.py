"""Features on a two-drive deepnvme Volume vs the same feature on one drive (each drive capped).

Usage: python benchmarks/bench_volume_features.py --drives DIR0 DIR1 [--size 1G] [--shards 8]
       [--params 48M] [--reps 5] [--label capped] [--json OUT]

Per repetition, the two layouts interleaved (their order alternating):
- "sharded safetensors": ``deepnvme.save_safetensors_sharded`` of SIZE bytes of fp32 tensors cut
  into SHARDS shards, timed until every file is fsynced and renamed, then
  ``deepnvme.load_safetensors`` of the folder (O_DIRECT reads: cold). On the volume each shard
  lies whole on one drive, the drives written and read at once; "1 drive" is a plain folder in DIR0.
- "dcp": ``dcp.save`` of the same tensors through ``NVMeStorageWriter(thread_count=4)`` (four
  data files), then ``dcp.load`` through ``NVMeStorageReader``, one process (no_dist).
- "optimizer step": ``NVMeOptimizer`` (AdamW, ``--sub-group`` bytes per sub-group) over PARAMS fp32
  parameters, its state (2 x 4 x PARAMS bytes) read and written every step: swap_dir the volume or
  a directory in DIR0. The I/O part of the step is measured alone by the same NVMeOptimizer over
  an AdamW that keeps AdamW's state but does not update ("I/O only"); the in-memory AdamW
  step over the same parameters is timed in the same rounds.
- "token samples": a Megatron indexed dataset of TOKENS bytes of uint16 tokens written once by
  ``write_token_dataset`` (on the volume: both files striped), then ``--samples`` samples of
  ``--seq-len`` + 1 tokens in a shuffled order read by ``TokenDataset.batches`` in batches of 64
  (read ahead; O_DIRECT: cold), the volume's batches split over both drives.
Medians over repetitions; ratios are 1 drive / volume within this run (the machine may be
shared: absolute times vary between runs, ratios less). CPU seconds from getrusage (this
process, all threads). GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import deepnvme  # noqa: E402
from deepnvme.checkpoint.dcp import NVMeStorageReader, NVMeStorageWriter  # noqa: E402
from deepnvme.config import parse_size  # noqa: E402
from deepnvme.data import TokenDataset, write_token_dataset  # noqa: E402


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), _cpu()
    fn()
    return time.perf_counter() - t0, _cpu() - c0


def _tensors(size: int, shards: int) -> dict[str, torch.Tensor]:
    """Four tensors per shard, of a few different sizes, SIZE bytes in all."""
    per = size // (4 * shards * 4)
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(4 * shards):
        n = per + (i % 4 - 1.5) * per // 8
        out[f"layer{i:03d}.weight"] = torch.randn(int(n), generator=g)
    return out


def _clear(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def sharded_round(tensors: dict[str, torch.Tensor], target: Any, folders: list[str],
                  max_shard: int) -> dict[str, float]:
    for f in folders:
        _clear(f)
    w, wc = timed(lambda: deepnvme.save_safetensors_sharded(tensors, target, max_shard_size=max_shard))
    box: dict[str, torch.Tensor] = {}
    r, rc = timed(lambda: box.update(deepnvme.load_safetensors(target)))
    assert box.keys() == tensors.keys()
    for f in folders:
        _clear(f)
    return {"save": w, "load": r, "save_cpu": wc, "load_cpu": rc}


def dcp_round(tensors: dict[str, torch.Tensor], target: Any, folders: list[str]) -> dict[str, float]:
    for f in folders:
        _clear(f)
    w, wc = timed(lambda: dcp.save(tensors, storage_writer=NVMeStorageWriter(target, thread_count=4),
                                   no_dist=True))
    back = {k: torch.empty_like(v) for k, v in tensors.items()}
    r, rc = timed(lambda: dcp.load(back, storage_reader=NVMeStorageReader(target), no_dist=True))
    for f in folders:
        _clear(f)
    return {"save": w, "load": r, "save_cpu": wc, "load_cpu": rc}


class StateOnlyAdamW(torch.optim.AdamW):
    """AdamW's state (two fp32 tensors per parameter) with no update: under NVMeOptimizer its
    step is the state's read and write alone, the I/O part of an AdamW step."""

    deepnvme_elementwise = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self.state[p].update(step=torch.zeros(()), exp_avg=torch.zeros_like(p),
                                         exp_avg_sq=torch.zeros_like(p))
        return None


def _params(n: int, pieces: int = 12) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(pieces):
        p = torch.nn.Parameter(torch.randn(n // pieces, generator=g))
        p.grad = torch.randn(n // pieces, generator=g) * 1e-3
        out.append(p)
    return out


def _corpus(prefix: Any, nbytes: int) -> None:
    g = torch.Generator().manual_seed(2)
    docs = (torch.randint(0, 50000, (1 << 20,), generator=g, dtype=torch.int32).to(torch.uint16)
            for _ in range(max(1, nbytes // (2 << 20))))
    write_token_dataset(prefix, docs)


def tokens_round(prefix: Any, seq_len: int, samples: int, seed: int) -> dict[str, float]:
    with TokenDataset(prefix, seq_len=seq_len) as ds:
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:samples].tolist()
        ds[0]  # the handle's threads start outside the timing
        total = [0]

        def read() -> None:
            for batch in ds.batches(order, 64):
                total[0] += int(batch[:, 0].sum())
        t, c = timed(read)
    return {"read": t, "read_cpu": c, "samples_per_s": len(order) / t, "cpu_us_per_sample": 1e6 * c / len(order)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drives", nargs=2, required=True, metavar="DIR")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"))
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--params", type=parse_size, default=parse_size("48M"))
    ap.add_argument("--sub-group", type=parse_size, default=parse_size("16M"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stripe", default="1M")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", type=parse_size, default=parse_size("512M"), help="corpus bytes")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--skip", nargs="*", default=[], choices=["sharded", "dcp", "optimizer", "tokens"])
    args = ap.parse_args()
    tag = f".bench-volfeat-{os.getpid()}"
    vol = deepnvme.Volume([os.path.join(d, tag) for d in args.drives], stripe=args.stripe)
    one = os.path.join(args.drives[0], tag + "-one")
    layouts: dict[str, tuple[Any, list[str]]] = {
        "volume": (vol / "ck", [os.path.join(p, "ck") for p in vol.paths]),
        "1 drive": (one, [one]),
    }
    tensors = _tensors(args.size, args.shards)
    total = sum(t.nbytes for t in tensors.values())
    max_shard = -(-total // args.shards) + (1 << 20)
    runs: dict[str, list[dict[str, float]]] = {}
    opts: dict[str, Any] = {}
    mem_opt = None
    try:
        if "optimizer" not in args.skip:
            swap = {"volume": vol, "1 drive": os.path.join(args.drives[0], tag + "-swap")}
            for name, where in swap.items():
                for cls, key in ((torch.optim.AdamW, name), (StateOnlyAdamW, f"{name}, I/O only")):
                    opts[key] = deepnvme.NVMeOptimizer(
                        _params(args.params), cls, swap_dir=where,
                        sub_group_bytes=args.sub_group, lr=1e-3)
                    opts[key].step()  # creates the state on disk (not timed)
            mem_opt = torch.optim.AdamW(_params(args.params), lr=1e-3)
            mem_opt.step()
        corpora = {"volume": vol / "corpus", "1 drive": os.path.join(one + "-tokens", "corpus")}
        if "tokens" not in args.skip:
            for where in corpora.values():
                _corpus(where, args.tokens)
        for rep in range(args.reps):
            order = list(layouts) if rep % 2 == 0 else list(reversed(layouts))
            for name in order:
                target, folders = layouts[name]
                if "sharded" not in args.skip:
                    runs.setdefault(f"sharded safetensors, {name}", []).append(
                        sharded_round(tensors, target, folders, max_shard))
                if "dcp" not in args.skip:
                    runs.setdefault(f"dcp, {name}", []).append(dcp_round(tensors, target, folders))
                if "tokens" not in args.skip:
                    runs.setdefault(f"token samples, {name}", []).append(
                        tokens_round(corpora[name], args.seq_len, args.samples, seed=rep))
                for key in (name, f"{name}, I/O only") if opts else ():
                    s, c = timed(opts[key].step)
                    runs.setdefault(f"optimizer step, {key}", []).append({"step": s, "step_cpu": c})
            if mem_opt is not None:
                s, c = timed(mem_opt.step)
                runs.setdefault("optimizer step, in memory", []).append({"step": s, "step_cpu": c})
    finally:
        for opt in opts.values():
            opt.close()
        for _, folders in layouts.values():
            for f in folders:
                _clear(f)
        for p in [*vol.paths, one, one + "-tokens", os.path.join(args.drives[0], tag + "-swap")]:
            _clear(p)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    ratios: dict[str, float] = {}
    print(f"{args.label}: checkpoint {total / 1e9:.2f} GB in {args.shards} shards, optimizer "
          f"{args.params / 1e6:.0f}M params ({2 * 4 * args.params / 1e9:.2f} GB state), {args.reps} "
          f"reps, {platform.node()} ({os.cpu_count()} CPUs)")
    for name, m in med.items():
        print(f"{name:<36} " + "  ".join(f"{k} {v:.3f}s" for k, v in m.items()))
    for feature in ("sharded safetensors", "dcp"):
        v, o = med.get(f"{feature}, volume"), med.get(f"{feature}, 1 drive")
        if v and o:
            for k in ("save", "load"):
                ratios[f"{feature} {k}"] = o[k] / v[k]
                print(f"{feature} {k}: {total / v[k] / 1e9:.2f} GB/s on the volume, "
                      f"{total / o[k] / 1e9:.2f} GB/s on 1 drive: {o[k] / v[k]:.2f}x")
    if opts and mem_opt is not None:
        base = med["optimizer step, in memory"]["step"]
        step_v, step_o = med["optimizer step, volume"]["step"], med["optimizer step, 1 drive"]["step"]
        io_v = med["optimizer step, volume, I/O only"]["step"]
        io_o = med["optimizer step, 1 drive, I/O only"]["step"]
        ratios["optimizer step"] = step_o / step_v
        ratios["optimizer step, I/O part"] = io_o / io_v
        print(f"optimizer step (AdamW): volume {step_v:.3f}s, 1 drive {step_o:.3f}s "
              f"({step_o / step_v:.2f}x), in memory {base:.3f}s; I/O part (state read and written, "
              f"no update): volume {io_v:.3f}s, 1 drive {io_o:.3f}s: {io_o / io_v:.2f}x")
    v, o = med.get("token samples, volume"), med.get("token samples, 1 drive")
    if v and o:
        ratios["token samples"] = v["samples_per_s"] / o["samples_per_s"]
        print(f"token samples (shuffled, {args.seq_len + 1} tokens): {v['samples_per_s']:.0f}/s on the volume "
              f"({v['cpu_us_per_sample']:.1f} CPU-us each), {o['samples_per_s']:.0f}/s on 1 drive "
              f"({o['cpu_us_per_sample']:.1f}): {ratios['token samples']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"label": args.label, "checkpoint_bytes": total, "shards": args.shards,
                       "params": args.params, "sub_group_bytes": args.sub_group,
                       "reps": args.reps, "stripe": args.stripe, "tokens": args.tokens, "seq_len": args.seq_len,
                       "samples": args.samples, "node": platform.node(),
                       "cpus": os.cpu_count(), "torch": torch.__version__, "drives": args.drives,
                       "runs": runs, "median_s": med, "ratios_one_drive_over_volume": ratios},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
