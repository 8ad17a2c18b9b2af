"""Text rendering and the optional matplotlib plot of :class:`~deepnvme.cli.tune.TuneResult`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from ..errors import DeepNVMeError
from ._render import fmt_size

if TYPE_CHECKING:
    from .tune import Trial, TuneResult

__all__ = ["render_tune", "require_matplotlib", "plot_tune"]


def _label(t: Trial) -> str:
    return (f"{t.engine} p={t.intra_op_parallelism} bs={fmt_size(t.block_size)} "
            f"qd={t.queue_depth}{' single_submit' if t.single_submit else ''}")


def render_tune(result: TuneResult, console: Console) -> None:
    """Print the trials table, the winners and the written config."""
    def say(text: str) -> None:
        console.print(text, soft_wrap=True, markup=False)

    say(f"deepnvme tune: {len(result.trials)} of {result.space_size} configurations "
                  f"measured in {result.elapsed:.1f} s (budget {result.budget:g} s), "
                  f"{fmt_size(result.io_size)} per transfer, median of {result.loops} loop(s), "
                  f"in {result.directory}")
    say("  writes timed until fsync returns, reads cold; GB = 1e9 bytes; "
                  "combined = (write + read bytes) / (write + read time)")
    swept_ss = len({t.single_submit for t in result.trials}) > 1
    table = Table(title="GB/s per configuration (threads = intra_op_parallelism"
                        f"{', ss = single_submit' if swept_ss else ''})", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("engine")
    for name in ("threads", "block_size", "queue_depth") + (("ss",) if swept_ss else ()):
        table.add_column(name, justify="right")
    for name in ("write", "read", "combined"):
        table.add_column(name, justify="right")
    table.add_column("best for")
    for i, t in enumerate(result.trials, 1):
        marks = ",".join(o for o, b in result.best.items() if b is t)
        ss = (str(t.single_submit).lower(),) if swept_ss else ()
        table.add_row(str(i), t.engine, str(t.intra_op_parallelism), fmt_size(t.block_size),
                      str(t.queue_depth), *ss, f"{t.write_gbps:.3f}", f"{t.read_gbps:.3f}",
                      f"{t.combined_gbps:.3f}", marks)
    console.print(table)
    for objective, t in result.best.items():
        say(f"  best {objective:8s}: {_label(t)}  ({t.score(objective):.3f} GB/s)")
    for note in result.notes:
        say(f"  note: {note}")
    where = f"written to {result.output}" if result.output else "not written (no --output)"
    say(f"  {result.objective} winner as a DeepSpeed config, {where}:")
    console.print(json.dumps(result.deepspeed_config(), indent=2), markup=False)


def require_matplotlib() -> Any:
    """Import matplotlib with a non-interactive backend, or raise a clear error."""
    try:
        import matplotlib
    except ImportError:
        raise DeepNVMeError("--plot needs matplotlib, an optional extra: "
                            "pip install 'deepnvme[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tune(result: TuneResult, path: str) -> None:
    """Grouped bars of write/read/combined GB/s per configuration, saved to ``path``."""
    plt = require_matplotlib()
    trials = result.trials
    xs = range(len(trials))
    width = 0.27
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(trials) + 2), 4.5))
    for k, name in enumerate(("write", "read", "combined")):
        ax.bar([x + (k - 1) * width for x in xs], [getattr(t, f"{name}_gbps") for t in trials], width,
               label=name)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([_label(t) for t in trials], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GB/s (1 GB = 1e9 bytes)")
    ax.set_title(f"deepnvme tune, {fmt_size(result.io_size)} transfers in {result.directory}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
