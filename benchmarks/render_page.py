#!/usr/bin/env python3
"""Print BENCHMARKS.md from benchmarks/page_template.md and the runs in benchmarks/results/*.json.

The template holds the prose. Each line of it that reads ``{{name}}`` is replaced by the table
that ``TABLES[name]`` computes from the result files it lists (the run chosen for that section),
followed by links to those files. Every figure in a table therefore comes from a JSON file, and
tests/functional/test_benchmark_page.py fails when BENCHMARKS.md is not what this script prints.
To show a newer run, point its entry in ``TABLES`` at the new file and rewrite the page.

Ratios are deepnvme's advantage everywhere: above 1 means deepnvme is better (its rate over the
peer's, or the peer's time over its time). Standard library only, so it runs without torch.

    python benchmarks/render_page.py            # print the page
    python benchmarks/render_page.py --write    # rewrite BENCHMARKS.md
    python benchmarks/render_page.py --check    # exit 1 when BENCHMARKS.md is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TEMPLATE = HERE / "page_template.md"
PAGE = HERE.parent / "BENCHMARKS.md"
LINK_PREFIX = "benchmarks/results/"  # result links as seen from BENCHMARKS.md at the repository root
PLACEHOLDER = re.compile(r"^\{\{([a-z_]+)\}\}$")
DISK, RAM = "development disk", "RAM device"
PASSIVE, THP = "OMP_WAIT_POLICY=PASSIVE", "THP_MEM_ALLOC_ENABLE="  # environment of a run
MiB = 2**20


@dataclass(frozen=True)
class Source:
    """One result file of a table: the device it ran on, and what distinguishes it (if anything)."""

    device: str
    file: str
    variant: str = ""


Run = tuple[Source, Any]  # a source and its parsed JSON
Rows = tuple[list[str], str]  # the table's lines, and a note printed before the links ("" for none)


@dataclass(frozen=True)
class Table:
    """A table of the page: the function that prints its rows, and the runs it reads."""

    rows: Callable[[Sequence[Run]], Rows]
    sources: tuple[Source, ...]


# ----------------------------------------------------------------------------- formatting


def ratio(value: float) -> str:
    return f"{value:.2f}x"


def header(*cols: str, left: int = 2) -> list[str]:
    """A markdown table head: the first ``left`` columns (labels) left-aligned, the figures right-aligned."""
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * left + "---:|" * (len(cols) - left)]


def row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def env(src: Source) -> str:
    """The variant of a run as a table cell: an environment setting in code style."""
    return f"`{src.variant}`" if "=" in src.variant else src.variant


def med(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def when(runs: Sequence[Run]) -> str:
    """'Runs of' each source's date (the JSON's ``date``, to the minute, UTC)."""
    return "runs of " + ", ".join(f"{s.device} {str(d['date'])[:16]}" for s, d in runs) + " UTC"


# ----------------------------------------------------------------------------- tensor I/O

ENGINE_OPS = (("write_new", "new-file write"), ("write", "overwrite"), ("read", "read"))


def engines_auto(runs: Sequence[Run]) -> Rows:
    """The default engine (``auto``) vs DeepSpeed at the same parallelism and fio, one transfer per
    fresh process: rates and CPU per byte, each as deepnvme's advantage."""
    out = header("device", "threads", *(f"{label} GB/s: deepnvme, DeepSpeed, fio" for _, label in ENGINE_OPS),
                 *(f"{label}: rate / DeepSpeed, / fio" for _, label in ENGINE_OPS),
                 "CPU per byte, DeepSpeed's / deepnvme's (new, over, read)", left=2)
    for src, data in runs:
        m = data["medians"]
        for p in data["args"]["parallelism"]:
            ours, ds, fio = m[f"deepnvme auto p{p}"], m[f"DeepSpeed aio p{p}"], m["fio libaio 1 job"]
            rates = [" / ".join(f"{t[op]['median']:.2f}" for t in (ours, ds, fio)) for op, _ in ENGINE_OPS]
            vs = [f"{ratio(ours[op]['median'] / ds[op]['median'])}, {ratio(ours[op]['median'] / fio[op]['median'])}"
                  for op, _ in ENGINE_OPS]
            cpu = ", ".join(ratio(ds[op]["cpu_per_gb"] / ours[op]["cpu_per_gb"]) for op, _ in ENGINE_OPS)
            out.append(row(src.device, p, *rates, *vs, cpu))
    size = runs[0][1]["args"]["size"] / MiB
    return out, (f"{size:.0f} MiB per transfer, {runs[0][1]['args']['reps']} interleaved rounds; fio runs one job "
                 "beside every thread count.")


# ----------------------------------------------------------------------------- CheckpointManager

MANAGER_SAVERS = {  # configuration in bench_manager.py -> label; in this order, those a run has
    "fenced": "CheckpointManager, fenced",
    "fenced_pre": "fenced, `fence_precopy=True`",
    "snapshot": "CheckpointManager, snapshot",
}
MANAGER_PEERS = {"dcp_async": "DCP `async_save`", "torch_thread": "`torch.save` on a thread"}


def manager(runs: Sequence[Run]) -> Rows:
    peers = ("DCP", "torch.save thread")
    out = header("device", "saver", "step s", "added s per step", "blocked s per save",
                 *(f"{what}: {peer} / this" for peer in peers for what in ("added", "blocked")))
    notes = []
    for src, data in runs:
        configs = data["configs"]
        for name, label in {**MANAGER_SAVERS, **MANAGER_PEERS}.items():
            if name not in configs:
                continue
            c = configs[name]
            cells = []
            for peer in MANAGER_PEERS if name in MANAGER_SAVERS else ():
                p = configs[peer]  # an added time at or below 0 (noise) has no ratio
                cells += [ratio(p["added_s"] / c["added_s"]) if c["added_s"] > 0 else "-",
                          ratio(p["blocked_s"] / c["blocked_s"])]
            out.append(row(src.device, label, f"{c['step_s']:.3f}", f"{c['added_s']:.3f}", f"{c['blocked_s']:.4f}",
                           *(cells or [""] * 4)))
        notes.append(f"{src.device}: baseline step {data['baseline_step_s']:.3f} s, one durable write "
                     f"{data['write_s']:.2f} s, plain memory copy {data['plain_copy_s']:.2f} s, batch {data['batch']}")
    return out, f"State {gb(runs[0][1]['state_bytes'])}; " + "; ".join(notes) + f"; {when(runs)}."


def restore(runs: Sequence[Run]) -> Rows:
    out = header("device", "environment", "deepnvme `restore` s", "`torch.load` s",
                 "`torch.load(mmap=True)` s", "vs torch.load", "vs torch.load(mmap=True)")
    for src, data in runs:
        m = data["restore_median_s"]
        ours = m["deepnvme_restore"]
        out.append(row(src.device, env(src), f"{ours:.3f}", f"{m['torch_load']:.3f}", f"{m['torch_load_mmap']:.3f}",
                       ratio(m["torch_load"] / ours), ratio(m["torch_load_mmap"] / ours)))
    return out, f"State {gb(runs[0][1]['state_bytes'])}; {when(runs)}."


def manager_ranks(runs: Sequence[Run]) -> Rows:
    """Two gloo ranks, a save every step: deepnvme's manager beside DCP async_save / dcp.load."""
    out = header("device", "saver", "step s", "added s", "blocked s per save", "GB per save (x state)",
                 "largest rank / mean", "restore s, cold", "added: DCP / this", "restore: DCP / this")
    notes = []
    for src, data in runs:
        c, state = data["configs"], data["state_bytes"]
        for name, label in (("deepnvme", "CheckpointManager, snapshot"), ("dcp_async", "DCP `async_save` / `load`")):
            x = c[name]
            mine = name == "deepnvme"
            added = ratio(c["dcp_async"]["added_s"] / x["added_s"]) if mine and x["added_s"] > 0 else ""
            out.append(row(src.device, label, f"{x['step_s']:.3f}", f"{x['added_s']:.3f}", f"{x['blocked_s']:.3f}",
                           f"{x['bytes_per_save'] / 1e9:.3f} ({x['bytes_per_save'] / state:.2f}x)",
                           f"{x['largest_share_over_mean']:.3f}", f"{x['restore_s']:.3f}", added,
                           ratio(c["dcp_async"]["restore_s"] / x["restore_s"]) if mine else ""))
        notes.append(f"{src.device}: baseline step {c['none']['step_s']:.3f} s")
    return out, (f"State {gb(runs[0][1]['state_bytes'])} per rank, replicated; " + "; ".join(notes)
                 + f"; targets: added >= 2.00x, restore >= 1.20x; {when(runs)}.")


# ----------------------------------------------------------------------------- loading

LOAD_INPUTS = {  # bench_load.py case -> label
    "st": "safetensors file", "pt": "torch.save file",
    "st_dir": "safetensors folder, 4 shards", "pt_dir": "torch.save folder, 4 shards",
    "into_st": "safetensors file", "into_pt": "torch.save file",
    "into_st_dir": "safetensors folder, 4 shards", "into_pt_dir": "torch.save folder, 4 shards",
}
LOAD_PEERS = {"safetensors": "safetensors", "fastsafetensors": "fastsafetensors", "runai": "runai streamer",
              "torch_load": "torch.load", "torch_mmap": "torch.load(mmap=True)"}


def load_medians(data: Any, case: str) -> dict[str, tuple[float, float]]:
    """Reader -> (median seconds, median peak RSS growth in bytes) for one case of bench_load.py."""
    out = {}
    for key, samples in data["results"].items():
        c, reader = key.split("/", 1)
        if c == case and samples:
            out[reader] = (med(s["seconds"] for s in samples), med(s["peak_rss_growth"] for s in samples))
    return out


SECOND_READER = {"deepnvme_mmap": "deepnvme `mmap=True` GB/s", "deepnvme_buffered": "deepnvme `o_direct=False` GB/s",
                 "deepnvme_direct": "deepnvme O_DIRECT path GB/s"}


def load_rows(runs: Sequence[Run], cases: Sequence[str], second: str, rss: bool) -> Rows:
    """One row per (device, input): deepnvme, its ``second`` reader, then each peer as
    'GB/s (deepnvme / peer)', in the order the run measured them; where a source has a variant,
    a column with it (the path the default call took, and what chose it)."""
    variants = any(src.variant for src, _ in runs)
    cols = ["device", "input", *(["deepnvme's path (chosen by)"] if variants else []), "deepnvme GB/s",
            SECOND_READER[second], "peers, GB/s (deepnvme / peer)"]
    out = header(*cols, *(["peak RSS growth MiB: deepnvme / peers"] if rss else []), left=3 if variants else 2)
    sizes = []
    for src, data in runs:
        nbytes = data["bytes"]
        sizes.append(f"{src.device} {gb(nbytes)}, {data['reps']} repetitions")
        for case in cases:
            m = load_medians(data, case)
            if not m:
                continue
            ours = m["deepnvme"][0]
            peers = [(LOAD_PEERS[r], s, g) for r, (s, g) in m.items() if not r.startswith("deepnvme")]
            cells = [src.device, LOAD_INPUTS[case], *([src.variant] if variants else []), f"{nbytes / ours / 1e9:.2f}",
                     f"{nbytes / m[second][0] / 1e9:.2f}" if second in m else "-",
                     ", ".join(f"{name} {nbytes / s / 1e9:.2f} ({ratio(s / ours)})" for name, s, _ in peers)]
            if rss:
                cells.append(f"{m['deepnvme'][1] / MiB:.0f} / " + ", ".join(f"{g / MiB:.0f}" for _, _, g in peers))
            out.append(row(*cells))
    return out, "Model size and repetitions: " + "; ".join(sizes) + "."


def load(runs: Sequence[Run]) -> Rows:
    return load_rows(runs, ("st", "pt", "st_dir", "pt_dir"), "deepnvme_direct", rss=False)


def load_into(runs: Sequence[Run]) -> Rows:
    return load_rows(runs, ("into_st", "into_pt", "into_st_dir", "into_pt_dir"), "deepnvme_buffered", rss=True)


# ----------------------------------------------------------------------------- DCP

DCP_CASES = {"large": "large: 1 GiB, 32 float32 tensors", "small": "small: 20,000 tensors of 1-64 KiB",
             "reshard": "reshard: half of each large tensor loaded"}


def dcp(runs: Sequence[Run]) -> Rows:
    out = header("device", "case", "stock save GB/s", "deepnvme save GB/s", "save ratio", "stock load GB/s",
                 "deepnvme load GB/s", "load ratio")
    for src, data in runs:
        for case, label in DCP_CASES.items():
            r = data["results"][case]
            cells = []
            for op in ("save", "load"):
                stock, ours = med(r["stock"][op]), med(r["deepnvme"][op])
                cells += [f"{stock:.2f}", f"{ours:.2f}", ratio(ours / stock)]
            out.append(row(src.device, label, *cells))
    return out, ""


# ----------------------------------------------------------------------------- training beyond memory


def offload(runs: Sequence[Run]) -> Rows:
    out = header("device", "gradients", "read + written per step", "deepnvme s per step", "DeepSpeed s per step",
                 "DeepSpeed / deepnvme", "deepnvme / roofline", "peak RSS MiB: deepnvme / DeepSpeed",
                 "CPU s per step: deepnvme / DeepSpeed")
    for src, data in runs:
        r = data["runs"]
        off, ds = med(t for s in r["offload"] for t in s["step_s"]), med(t for s in r["deepspeed"] for t in s["step_s"])
        first = r["offload"][0]
        moved = f"{first['read_per_step'] / 1e9:.2f} + {first['written_per_step'] / 1e9:.2f} GB"
        rss = max(s["rss"] for s in r["offload"]) / MiB, max(s["rss"] for s in r["deepspeed"]) / MiB
        cpu = med(t for s in r["offload"] for t in s["cpu_s"]), med(t for s in r["deepspeed"] for t in s["cpu_s"])
        out.append(row(src.device, src.variant, moved, f"{off:.2f}", f"{ds:.2f}", ratio(ds / off),
                       f"{off / data['roofline_s']:.2f}", f"{rss[0]:.0f} / {rss[1]:.0f}",
                       f"{cpu[0]:.2f} / {cpu[1]:.2f}"))
    return out, ""


# ----------------------------------------------------------------------------- vLLM


def vllm_load(runs: Sequence[Run]) -> Rows:
    out = header("device", "deepnvme `load_weights` s", "safetensors s (deepnvme / it)",
                 "runai_streamer s (deepnvme / it)", "`LLM()` s: deepnvme / safetensors",
                 "peak RSS: deepnvme / safetensors", left=1)
    for src, data in runs:
        m = data["median"]
        ours = m["deepnvme"]["load_weights_s"]
        peers = [f"{m[p]['load_weights_s']:.2f} ({ratio(m[p]['load_weights_s'] / ours)})"
                 for p in ("safetensors", "runai_streamer")]
        out.append(row(src.device, f"{ours:.2f}", *peers,
                       f"{m['deepnvme']['construct_s']:.2f} / {m['safetensors']['construct_s']:.2f}",
                       f"{m['deepnvme']['peak_rss'] / m['safetensors']['peak_rss']:.3f}"))
    first = runs[0][1]
    return out, f"Model {gb(first['model_bytes'])} in {first['shards']} shards; {when(runs)}."


def vllm_stream(runs: Sequence[Run]) -> Rows:
    out = header("device", "environment", "streamed decode tok/s", "in memory tok/s", "I/O roofline tok/s",
                 "streamed / min(roofline, in memory)", "peak RSS MiB: streamed / in memory", "weights / budget")
    for src, data in runs:
        m, r = data["median"], data["ratios"]
        streamed = m["deepnvme_stream"] if "deepnvme_stream" in m else m["deepnvme_offload"]  # runs before the rename
        out.append(row(src.device, env(src), f"{streamed['decode_tok_s']:.1f}",
                       f"{m['memory']['decode_tok_s']:.1f}", f"{r['io_roofline_tok_s']:.1f}",
                       ratio(r["decode_vs_bound"]),
                       f"{streamed['peak_rss'] / MiB:.0f} / {m['memory']['peak_rss'] / MiB:.0f}",
                       ratio(r["weights_over_budget"])))
    first = runs[0][1]
    return out, f"Model {gb(first['model_bytes'])}, memory budget {gb(first['budget'])}; {when(runs)}."


def offload_ranks(runs: Sequence[Run]) -> Rows:
    out = header("device", "mode", "step s", "CPU s", "written per step GB (/ one process)", "read per step GB",
                 "peak RSS MiB", "held / budget MiB", left=2)
    names = {"single": "one process", "fsdp": "FSDP2 + offload, per rank", "fsdp_memory": "FSDP2 in memory, per rank",
             "deepspeed": "DeepSpeed ZeRO-3 on NVMe, per rank"}
    for src, data in runs:
        summary = data["summary"]
        one = summary["single"]["written_per_step"]
        for mode, label in names.items():
            r = summary.get(mode)
            if r is None:
                continue
            written = r.get("written_per_step", r.get("io_write_bytes"))  # DeepSpeed: its swap files' writes
            out.append(row(src.device, label, f"{r['step_s']:.2f}", f"{r['cpu_s']:.2f}",
                           f"{written / 1e9:.3f} ({written / one:.3f}x)" if written else "-",
                           f"{r['read_per_step'] / 1e9:.3f}" if r.get("read_per_step") else "-",
                           f"{r['rss'] / MiB:.0f}",
                           f"{r['peak_held'] / MiB:.0f} / {r['budget'] / MiB:.0f}" if r.get("budget") else "-"))
    a, first = runs[0][1]["args"], runs[0][1]
    load = (first["load_average"] if "load_average" in first else first["load_average_start"])[0]
    versus = "; ".join(f"{src.device}: FSDP2 + offload step / DeepSpeed's {data['summary']['step_vs_deepspeed']:.2f}"
                       for src, data in runs if "step_vs_deepspeed" in data["summary"])
    return out, (f"{a['layers']} x Linear({a['dim']}) + ReLU, AdamW, batch {a['batch']} per rank, "
                 f"{a['world']} gloo ranks; load average {load:.0f} at the start (a shared machine): "
                 "read the bytes first." + (f" {versus}." if versus else ""))


def hf_load(runs: Sequence[Run]) -> Rows:
    out = header("device", "deepnvme s", "transformers s", "deepnvme / transformers", "CPU s: deepnvme / transformers",
                 "peak RSS growth: deepnvme / transformers", left=1)
    for src, data in runs:
        m, r = data["medians"], data["summary"]
        cpu = f"{m['deepnvme']['cpu_seconds']:.2f} / {m['transformers']['cpu_seconds']:.2f}"
        out.append(row(src.device, f"{m['deepnvme']['seconds']:.2f}", f"{m['transformers']['seconds']:.2f}",
                       ratio(r["speedup"]), cpu, f"{r['rss_ratio']:.3f}"))
    d = runs[0][1]
    return out, (f"Llama, {d['layers']} layers, hidden {d['hidden']}, {d['dtype']}, {gb(d['bytes'])} in "
                 f"{d['shard_size']} shards, transformers {d['transformers']}; medians of {d['reps']}.")


# ----------------------------------------------------------------------------- GPU


def gpu_io(runs: Sequence[Run]) -> Rows:
    out = header("device", "run", "path", "write GB/s", "read GB/s", "write / CPU pinned", "read / CPU pinned",
                 "write / KvikIO", "read / KvikIO", left=3)
    for src, data in runs:
        rows = data["rows"]
        pinned = rows[0]
        kvik = next((r for r in rows if r["peer"].startswith("kvikio")), None)
        for r in rows:
            vs_kvik = (["-", "-"] if kvik is None or r is kvik else
                       [ratio(r["write"] / kvik["write"]), ratio(r["read"] / kvik["read"])])
            out.append(row(src.device, src.variant, r["peer"], f"{r['write']:.2f}", f"{r['read']:.2f}",
                           ratio(r["write"] / pinned["write"]), ratio(r["read"] / pinned["read"]), *vs_kvik))
    first = runs[0][1]
    return out, f"{first['machine']}; {gb(first['size'])} per transfer, medians of the runs in the JSON."


def gpu_load(runs: Sequence[Run]) -> Rows:
    out = header("device", "reader", "GB/s", "this reader / fastsafetensors (no GDS)", "equal to the CPU values",
                 left=2)
    for src, data in runs:
        rows = {r["reader"]: r for r in data["rows"]}
        peer = rows.get("fastsafetensors", {}).get("gb_per_s")
        for name, r in rows.items():
            rate = r["gb_per_s"]
            out.append(row(src.device, name, f"{rate:.2f}" if rate else "failed",
                           ratio(rate / peer) if rate and peer and name != "fastsafetensors" else "-",
                           "yes" if r["equal"] else "no"))
    first = runs[0][1]
    return out, f"{first['machine']}; {gb(first['bytes'])} of bf16 tensors, cold, medians of {first['reps']} runs."


def gpu_offload(runs: Sequence[Run]) -> Rows:
    out = header("device", "peer", "step s", "step / all on the GPU", "step / GPU with CPU update",
                 "device memory held GiB", "device peak GiB", left=2)
    for src, data in runs:
        peers = {p["peer"]: p for p in data["peers"]}
        gpu, cpu_update = peers["gpu"]["step_s_median"], peers["gpu, cpu update"]["step_s_median"]
        for name, p in peers.items():
            step = p["step_s_median"]
            out.append(row(src.device, name, f"{step:.3f}", f"{step / gpu:.1f}x", f"{step / cpu_update:.2f}x",
                           f"{p['device_held_bytes'] / 2**30:.3f}", f"{p['device_peak_bytes'] / 2**30:.3f}"))
    m = runs[0][1]["model"]
    return out, (f"GPT of {m['params'] / 1e6:.1f}M fp32 parameters, batch {m['batch']} x {m['seq']} tokens, AdamW; "
                 "times: slower is larger (not deepnvme's advantage).")


# ----------------------------------------------------------------------------- token data

DATA_PEERS = ("megatron-core", "np.memmap")


def data_table(runs: Sequence[Run]) -> Rows:
    out = header("device", "order", "deepnvme samples/s", *(f"{p} samples/s (deepnvme / it)" for p in DATA_PEERS),
                 "CPU us / sample: deepnvme, " + ", ".join(DATA_PEERS))
    dates = []
    for src, data in runs:
        rows = {(r["order"], r["reader"]): r for r in data["rows"]}
        for order in ("shuffled", "sequential"):
            readers = ("deepnvme", *DATA_PEERS)
            rate = {reader: rows[(order, reader)]["samples_per_s"]["median"] for reader in readers}
            cpu = [rows[(order, reader)].get("cpu_us_per_sample", {}).get("median") for reader in readers]
            out.append(row(src.device, order, f"{rate['deepnvme']:,.0f}",
                           *(f"{rate[p]:,.0f} ({ratio(rate['deepnvme'] / rate[p])})" for p in DATA_PEERS),
                           " / ".join("-" if c is None else f"{c:.1f}" for c in cpu)))
        dates.append(f"{src.device} {gb(data['corpus_bytes'])}")
    return out, "Corpus: " + ", ".join(dates) + f"; {when(runs)}; CPU: getrusage, every thread, user + system."


# ----------------------------------------------------------------------------- volumes

VOLUME = "deepnvme volume"


def volume(runs: Sequence[Run]) -> Rows:
    out = header("drives", "tool", "write GB/s", "read GB/s", "volume / it: write, read")
    for src, data in runs:
        med_s = data["median_s"]
        rate = {tool: {op: data["size"] / 1e9 / med_s[tool][op] for op in ("write", "read")} for tool in med_s}
        for tool in med_s:
            out.append(row(src.device, tool.replace("raid0", "RAID-0"), f"{rate[tool]['write']:.2f}",
                           f"{rate[tool]['read']:.2f}", "-" if tool == VOLUME else ", ".join(
                               ratio(rate[VOLUME][op] / rate[tool][op]) for op in ("write", "read"))))
    return out, "; ".join(f"{src.device}: {data['reps']} interleaved repetitions, stripe {data['stripe']}, "
                          f"{data['engine']}" for src, data in runs) + "."


# ----------------------------------------------------------------------------- quantised streaming

def stream_quant(runs: Sequence[Run]) -> Rows:
    out = header("device", "weights, group", "GB read / token", "decode tokens/s (vs bf16)", "CPU s / token",
                 "logits max / mean abs error, top-1 equal")
    for src, data in runs:
        group = data["config"]["group_size"]
        for mode, t in data["throughput"].items():
            acc = data["accuracy"].get(mode)
            label = f"{mode}, group {group}" if acc else f"{mode} (run of group {group})"
            out.append(row(src.device, label, f"{t['streamed_gb_per_token']:.3f}",
                           f"{t['decode_tok_s']:.2f} ({ratio(t['speedup_vs_bf16'])})", f"{t['cpu_s_per_token']:.2f}",
                           f"{acc['max_abs_err']:.2f} / {acc['mean_abs_err']:.3f}, {100 * acc['same_top1']:.0f} %"
                           if acc else "-"))
    return out, "Load average at the end: " + ", ".join(
        f"group {data['config']['group_size']} {data['loadavg'][0]:.1f}" for _, data in runs) + "."


# ----------------------------------------------------------------------------- the page

TABLES: dict[str, Table] = {
    "engines_auto": Table(engines_auto, (Source(DISK, "2026-12-06-engines-fresh-disk.json"),
                                         Source(RAM, "2026-12-06-engines-fresh-ramdev.json"))),
    # the latest runs with DCP's async_save and the torch.save thread beside deepnvme's savers
    "manager": Table(manager, (Source(DISK, "2026-11-25-manager-fence-work.json"),
                               Source(RAM, "2026-11-25-manager-fence-ramdev.json"))),
    # the latest runs of deepnvme's savers (no peers), with OpenMP's default and passive wait policy
    "restore": Table(restore, (
        Source(DISK, "2026-11-25-manager-restore-thp1-work.json", THP + "1"),
        Source(DISK, "2026-11-25-manager-restore-thp0-work.json", THP + "0"),
        Source(RAM, "2026-11-26-manager-restore-thp1-ramdev.json", THP + "1"),
        Source(RAM, "2026-11-26-manager-restore-thp0-ramdev.json", THP + "0"))),
    # two gloo ranks of a DDP job, a save every step
    # the same after the shared restore reads and cached plans, on a heavily loaded machine
    "manager_ranks_shared": Table(manager_ranks, (Source(DISK, "2026-11-27-manager-ranks-shared-disk.json"),
                                                  Source(RAM, "2026-11-27-manager-ranks-shared-ramdev.json"))),
    # deepnvme = the default call; its path is the device's cached choice (the variant says which)
    "load": Table(load, (Source(DISK, "2026-12-07-load-fresh-disk-tuned.json", "direct (`tune --load`)"),
                         Source(RAM, "2026-12-07-load-fresh-ramdev-firstuse.json", "direct (first-use probe)"),
                         Source(RAM, "2026-12-07-load-fresh-ramdev-tuned.json", "mapped (`tune --load`)"))),
    # files and folders in the same repetitions on each device
    "load_into": Table(load_into, (Source(DISK, "2026-11-26-load-into-dirs-side-disk.json"),
                                   Source(RAM, "2026-11-26-load-into-dirs-ramdev.json"))),
    "dcp": Table(dcp, (Source(DISK, "2026-11-25-dcp3-disk.json"), Source(RAM, "2026-11-25-dcp3-ramdev.json"))),
    "offload": Table(offload, (
        Source(DISK, "2026-11-29-offload-params-disk-kg0.json", "default (fused)"),
        Source(DISK, "2026-11-29-offload-params-disk-kg1.json", "in memory"),
        Source(RAM, "2026-11-29-offload-params-ramdev-ds-quiet.json", "default (fused)"),
        Source(RAM, "2026-11-29-offload-params-ramdev-kg1.json", "in memory"))),
    "vllm_load": Table(vllm_load, (Source(DISK, "2026-11-26-vllm-load-disk-reuse.json"),
                                   Source(RAM, "2026-11-26-vllm-load-ramdev-reuse.json"))),
    "vllm_stream": Table(vllm_stream, (
        Source(DISK, "2026-11-25-vllm-offload-disk.json", "OpenMP default"),
        Source(RAM, "2026-11-26-vllm-offload-ramdev-trim2.json", "OpenMP default"),
        Source(RAM, "2026-11-26-vllm-offload-ramdev-passive.json", PASSIVE))),
    # two runs of one session on the same machine: the disk's speed moved between them
    "offload_ranks": Table(offload_ranks, (Source(DISK, "2026-11-29-offload-ranks-disk-merged.json"),
                                           Source(RAM, "2026-11-29-offload-ranks-ramdev-merged.json"))),
    "hf_load": Table(hf_load, (Source(DISK, "2026-11-28-hf-load-r28-disk.json"),
                               Source(RAM, "2026-11-28-hf-load-r28-ramdev.json"))),
    "gpu_io": Table(gpu_io, (Source("H200", "2026-11-27-gpu-io-h200-run2.json", "run 2"),
                             Source("H200", "2026-11-27-gpu-io-h200-run3.json", "run 3"))),
    "gpu_load": Table(gpu_load, (Source("H200", "2026-11-27-gpu-load-h200-run3.json", "run 3"),)),
    "gpu_offload": Table(gpu_offload, (Source("H200", "2026-11-27-gpu-offload-h200.json"),)),
    "volume": Table(volume, (Source("2 RAM devices, 1 GiB/s each", "2026-11-27-volume-capped-2.json"),
                             Source("2 RAM devices, uncapped", "2026-11-27-volume-uncapped.json"))),
    "stream_quant": Table(stream_quant, (Source(DISK, "2026-11-27-stream-quant-disk.json"),
                                         Source(DISK, "2026-11-27-stream-quant-disk-g64.json", "group 64"))),
    "data": Table(data_table, (Source(DISK, "2026-12-07-tokens-disk.json"),
                               Source(RAM, "2026-12-07-tokens-ramdev-merged.json"))),
}


def read_run(results: Path, src: Source) -> Run:
    path = results / src.file
    try:
        with open(path) as f:
            return src, json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"render_page: {path} (listed in TABLES) does not exist") from None


def table(name: str, results: Path = RESULTS) -> list[str]:
    """The rows of table ``name`` and the links to its JSON files."""
    spec = TABLES[name]
    runs = [read_run(results, s) for s in spec.sources]
    try:
        lines, note = spec.rows(runs)
    except KeyError as e:
        files = ", ".join(s.file for s in spec.sources)
        raise KeyError(f"render_page: table {name!r} needs the key {e} missing in one of {files}") from None
    links = ", ".join(f"[{s.file}]({LINK_PREFIX}{s.file})" for s in spec.sources)
    return [*lines, "", f"{note} JSON: {links}.".lstrip()]


def render(template: Path = TEMPLATE, results: Path = RESULTS) -> str:
    """The page: the template with every ``{{name}}`` line replaced by its table."""
    out: list[str] = []
    for n, line in enumerate(template.read_text().splitlines(), 1):
        m = PLACEHOLDER.match(line.strip())
        if not m:
            out.append(line)
        elif m.group(1) in TABLES:
            out += table(m.group(1), results)
        else:
            raise KeyError(f"render_page: {template}:{n} names {{{{{m.group(1)}}}}}, which TABLES does not have")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=f"Print {PAGE.name} from {TEMPLATE.name} and {RESULTS.name}/*.json.")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {PAGE.name}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 if {PAGE.name} differs from the output")
    args = ap.parse_args(argv)
    page = render()
    if args.write:
        PAGE.write_text(page)
    elif args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE} is out of date: run python benchmarks/render_page.py --write", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
