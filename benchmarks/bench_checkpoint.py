"""Checkpoint save/load GB/s: deepnvme vs torch, safetensors, DCP and fio, one run, one directory.

Usage: python benchmarks/bench_checkpoint.py [--dir DIR] [--layers 8] [--reps 3]

A transformer-shaped bf16 state dict (embedding, lm_head, per layer q/k/v/o, gate/up/down and
two norms; hidden 2048, MLP 5632, vocab 32000: about 1.1 GB with 8 layers) is saved and loaded
by every tool into the same directory, rounds interleaved across tools (each round starts
with a different tool, so no tool always runs first after the writes). Saves are timed until
the bytes are on stable storage (deepnvme fsyncs itself; torch.save, safetensors and DCP
writes are followed by an fsync of every file they wrote, DCP's own ``sync_files`` included).
Loads are cold: every file is fsynced and dropped from the page cache
(``posix_fadvise(DONTNEED)``) first; ``torch.load(mmap=True)`` is timed until every page of
every tensor has been touched. fio moves the same number of bytes sequentially
(libaio, O_DIRECT, 1 MiB blocks, queue depth 32, end_fsync) as the disk's limit, writing
both a new file (as every checkpoint save does) and over an existing one.
``async_save`` rows: time the caller is blocked (snapshot), and total time until durable.
deepnvme frees a file it replaced on a background thread after the save returns; the script
waits for that between tools (untimed) and also reports deepnvme.save timed until then.
``recycle=True`` keeps the replaced file as a spare that the next save overwrites in place.
Last, ``--pair-rounds`` rounds time an ``async_save`` (caller blocked) and a ``deepnvme.save``
back to back with no other tool in between.
GB = 1e9 bytes; medians over repetitions.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import deepnvme
from deepnvme.checkpoint import wait_for_releases
from deepnvme.checkpoint.dcp import NVMeStorageReader, NVMeStorageWriter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import describe_machine, ensure_fio, fio  # noqa: E402


def make_state(layers: int, hidden: int = 2048, mlp: int = 5632, vocab: int = 32000
               ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = w(hidden, hidden)
        sd[p + "mlp.gate_proj.weight"] = w(mlp, hidden)
        sd[p + "mlp.up_proj.weight"] = w(mlp, hidden)
        sd[p + "mlp.down_proj.weight"] = w(hidden, mlp)
        sd[p + "input_layernorm.weight"] = w(hidden)
        sd[p + "post_attention_layernorm.weight"] = w(hidden)
    sd["model.norm.weight"] = w(hidden)
    sd["lm_head.weight"] = w(vocab, hidden)
    return sd


def files_of(path: str) -> list[str]:
    if os.path.isdir(path):
        return [os.path.join(path, f) for f in os.listdir(path)]
    return [path]


def sync_and_evict(path: str, *, evict: bool) -> None:
    for f in files_of(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            if evict:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if os.path.isdir(path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)


def touch_all(obj: dict[str, torch.Tensor]) -> None:
    for t in obj.values():
        b = t.reshape(-1).view(torch.uint8)
        if b.numel():
            b[::4096].sum()


def timed_save(fn: Callable[[str], None], path: str) -> tuple[float, float]:
    """Seconds until the save is durable, and until the file it replaced was freed too.

    deepnvme frees a replaced file on a background thread; waiting for that here (untimed
    for the first number) keeps one tool's clean-up out of the next tool's timing.
    """
    if os.path.isdir(path):
        shutil.rmtree(path)
    t0 = time.perf_counter()
    fn(path)
    sync_and_evict(path, evict=False)  # to stable storage (a no-op cost for deepnvme's files)
    durable = time.perf_counter() - t0
    wait_for_releases()
    return durable, time.perf_counter() - t0


def timed_load(fn: Callable[[str], object], path: str) -> float:
    sync_and_evict(path, evict=True)
    t0 = time.perf_counter()
    out = fn(path)
    dt = time.perf_counter() - t0
    del out
    return dt


def rotated(names: list[str], rep: int) -> list[str]:
    """The tools in a different order each round: the first read after a burst of writes was
    measured 15-20% slower on this virtual disk, whichever tool it was."""
    k = rep % len(names)
    return names[k:] + names[:k]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pair-rounds", type=int, default=5,
                    help="extra rounds of async_save then deepnvme.save alone, back to back")
    args = ap.parse_args()
    have_fio = ensure_fio()
    state = make_state(args.layers)
    nbytes = sum(t.nbytes for t in state.values())
    work = os.path.join(os.path.abspath(args.dir), f".deepnvme-bench-ckpt-{os.getpid()}")
    os.makedirs(work)
    p = {k: os.path.join(work, k) for k in ("dn.pt", "dn_recycle.pt", "torch.pt", "dn.safetensors",
                                            "st.safetensors", "dcp_nvme", "dcp_fs", "async.pt",
                                            "fio.bin")}

    def dcp_load(reader_cls: type) -> Callable[[str], object]:
        def run(path: str) -> object:
            target = {k: torch.empty_like(v) for k, v in state.items()}
            dcp.load(target, storage_reader=reader_cls(path), no_dist=True)
            return target
        return run

    def torch_mmap(path: str) -> object:
        out = torch.load(path, weights_only=True, mmap=True)
        touch_all(out)
        return out

    saves: dict[str, tuple[Callable[[str], None], str]] = {
        "deepnvme.save": (lambda f: deepnvme.save(state, f), p["dn.pt"]),
        "deepnvme.save recycle=True": (lambda f: deepnvme.save(state, f, recycle=True),
                                       p["dn_recycle.pt"]),
        "torch.save": (lambda f: torch.save(state, f), p["torch.pt"]),
        "deepnvme.save_safetensors": (lambda f: deepnvme.save_safetensors(state, f), p["dn.safetensors"]),
        "safetensors save_file": (lambda f: save_file(state, f), p["st.safetensors"]),
        "DCP NVMeStorageWriter": (lambda f: dcp.save(state, storage_writer=NVMeStorageWriter(f),
                                                     no_dist=True), p["dcp_nvme"]),
        "DCP FileSystemWriter": (lambda f: dcp.save(state, storage_writer=dcp.FileSystemWriter(f),
                                                    no_dist=True), p["dcp_fs"]),
    }
    loads: dict[str, tuple[Callable[[str], object], str]] = {
        "deepnvme.load": (deepnvme.load, p["dn.pt"]),
        "deepnvme.load (recycled file)": (deepnvme.load, p["dn_recycle.pt"]),
        "torch.load": (lambda f: torch.load(f, weights_only=True), p["torch.pt"]),
        "torch.load mmap=True": (torch_mmap, p["torch.pt"]),
        "deepnvme.load_safetensors": (deepnvme.load_safetensors, p["dn.safetensors"]),
        "safetensors load_file": (load_file, p["st.safetensors"]),
        "DCP NVMeStorageReader": (dcp_load(NVMeStorageReader), p["dcp_nvme"]),
        "DCP FileSystemReader": (dcp_load(dcp.FileSystemReader), p["dcp_fs"]),
    }
    pairs = {"deepnvme.save": "deepnvme.load",
             "deepnvme.save recycle=True": "deepnvme.load (recycled file)",
             "torch.save": "torch.load",
             "deepnvme.save_safetensors": "deepnvme.load_safetensors",
             "safetensors save_file": "safetensors load_file",
             "DCP NVMeStorageWriter": "DCP NVMeStorageReader",
             "DCP FileSystemWriter": "DCP FileSystemReader"}
    wr: dict[str, list[float]] = {k: [] for k in saves}
    freed_too: dict[str, list[float]] = {k: [] for k in saves}
    rd: dict[str, list[float]] = {k: [] for k in loads}
    block: list[float] = []
    total: list[float] = []
    fio_w: list[float] = []
    fio_new: list[float] = []
    fio_r: list[float] = []
    ck = deepnvme.AsyncCheckpointer()
    try:
        ck.save(state, p["async.pt"]).wait()  # arena allocated once, reused by the timed saves
        for _ in range(2):  # the second leaves a spare: every timed recycle=True save has one
            deepnvme.save(state, p["dn_recycle.pt"], recycle=True)
        wait_for_releases()
        for rep in range(args.reps):
            for name in rotated(list(saves), rep):
                fn, path = saves[name]
                durable, freed = timed_save(fn, path)
                wr[name].append(durable)
                freed_too[name].append(freed)
            for name in rotated(list(loads), rep):
                fn, path = loads[name]
                rd[name].append(timed_load(fn, path))
            t0 = time.perf_counter()
            h = ck.save(state, p["async.pt"])
            block.append(time.perf_counter() - t0)
            h.wait()
            total.append(time.perf_counter() - t0)
            wait_for_releases()
            if have_fio:
                if os.path.exists(p["fio.bin"]):
                    os.unlink(p["fio.bin"])  # a new file, as every checkpoint save makes
                fio_new.append(fio(p["fio.bin"], nbytes, "write"))
                fio_w.append(fio(p["fio.bin"], nbytes, "write"))
                sync_and_evict(p["fio.bin"], evict=True)
                fio_r.append(fio(p["fio.bin"], nbytes, "read"))
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
        pair_block: list[float] = []
        pair_sync: list[float] = []
        for _ in range(args.pair_rounds):  # the two saves alone, away from the other tools
            t0 = time.perf_counter()
            h = ck.save(state, p["async.pt"])
            pair_block.append(time.perf_counter() - t0)
            h.wait()
            wait_for_releases()
            pair_sync.append(timed_save(lambda f: deepnvme.save(state, f), p["dn.pt"])[0])
        check = deepnvme.load(p["dn.pt"])
        if not all(torch.equal(check[k], v) for k, v in state.items()):
            raise SystemExit("deepnvme.load returned different tensors")
    finally:
        ck.close()
        shutil.rmtree(work)

    med = statistics.median
    gbs = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    print(describe_machine(args.dir))
    print(f"state dict: {len(state)} bf16 tensors, {nbytes / 1e9:.2f} GB; {args.reps} reps, "
          "median GB/s [min-max]")
    fw = gbs(med(fio_w)) if fio_w else None
    fr = gbs(med(fio_r)) if fio_r else None
    fn = gbs(med(fio_new)) if fio_new else None
    print("| tool (save / load) | save GB/s | load GB/s | save / fio | save / fio new file "
          "| load / fio |")
    print("|---|---|---|---|---|---|")

    def cell(xs: list[float]) -> str:
        return f"{gbs(med(xs)):.2f} [{gbs(max(xs)):.2f}-{gbs(min(xs)):.2f}]"

    for s, l_ in pairs.items():
        ratio_w = f"{gbs(med(wr[s])) / fw:.2f}" if fw else "-"
        ratio_n = f"{gbs(med(wr[s])) / fn:.2f}" if fn else "-"
        ratio_r = f"{gbs(med(rd[l_])) / fr:.2f}" if fr else "-"
        print(f"| {s} / {l_} | {cell(wr[s])} | {cell(rd[l_])} | {ratio_w} | {ratio_n} | {ratio_r} |")
    mm = rd["torch.load mmap=True"]
    mm_ratio = f"{gbs(med(mm)) / fr:.2f}" if fr else "-"
    print(f"| torch.load mmap=True (all pages touched) | - | {cell(mm)} | - | - | {mm_ratio} |")
    if fio_w:
        print(f"| fio seq write, existing file / read (libaio, direct, qd32) | {cell(fio_w)} | "
              f"{cell(fio_r)} | 1.00 | - | 1.00 |")
        print(f"| fio seq write, new file | {cell(fio_new)} | - | - | 1.00 | - |")
    dn, ts = med(wr["deepnvme.save"]), med(wr["torch.save"])
    print()
    print(f"deepnvme.save vs torch.save: {ts / dn:.2f}x")
    print(f"deepnvme.save timed until the replaced file was freed as well (on its background "
          f"thread): {cell(freed_too['deepnvme.save'])} GB/s, {ts / med(freed_too['deepnvme.save']):.2f}x "
          "torch.save")
    print(f"async_save: caller blocked {med(block) * 1e3:.0f} ms [{min(block) * 1e3:.0f}-"
          f"{max(block) * 1e3:.0f}], durable after {med(total) * 1e3:.0f} ms; blocked / "
          f"deepnvme.save time = {med(block) / dn:.1%}")
    if pair_block:
        print(f"async_save then deepnvme.save alone, {len(pair_block)} rounds: caller blocked "
              f"{med(pair_block) * 1e3:.0f} ms [{min(pair_block) * 1e3:.0f}-"
              f"{max(pair_block) * 1e3:.0f}], deepnvme.save {med(pair_sync) * 1e3:.0f} ms "
              f"[{min(pair_sync) * 1e3:.0f}-{max(pair_sync) * 1e3:.0f}]; blocked / save = "
              f"{med(pair_block) / med(pair_sync):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
