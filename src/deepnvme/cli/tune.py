"""``deepnvme tune``: which handle settings are best on this storage? (DeepSpeed's ds_nvme_tune).

Parses the options, runs :func:`~deepnvme.bench.run_tune` (the search is described in
:mod:`deepnvme.bench.tune`), prints the trials and the winners (or JSON) and draws ``--plot``.
Output paths are checked before the sweep, so a long run does not fail at its end.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from ..bench import Trial, TuneInterrupted, TuneResult, TuneSpace, default_space, load_space, run_tune
from ..bench._files import check_writable
from ..bench.tune import OBJECTIVES
from ..checkpoint._load_path import cache_file
from ..checkpoint._load_probe import measure_dir
from ..config import checkpoint_config
from ..errors import DeepNVMeError
from ._args import positive_float, positive_int, positive_size
from ._render import fmt_size, print_json, progress_bar, stdout_console

__all__ = ["add_tune_parser", "render_tune", "plot_tune", "require_matplotlib", "run_tune"]


def add_tune_parser(subparsers: Any) -> None:
    """Register ``deepnvme tune``."""
    t = subparsers.add_parser("tune", help="find the best handle settings, like ds_nvme_tune",
                              description=__doc__.split("\n\n")[0])
    t.add_argument("--dir", default=".", help="directory for the temporary file (default: .)")
    t.add_argument("--space", default=None, metavar="FILE",
                   help="JSON/YAML file of candidate values per setting (default: built in)")
    t.add_argument("--io-size", type=positive_size, default=256 << 20, metavar="SIZE",
                   help="bytes per transfer (default: 256M)")
    t.add_argument("--loops", type=positive_int, default=2, help="transfers per config and op (default: 2)")
    t.add_argument("--budget", type=positive_float, default=120.0, metavar="SECONDS",
                   help="stop measuring new configurations after this long (default: 120)")
    t.add_argument("--objective", choices=OBJECTIVES, default="combined",
                   help="which winner goes to --output (default: combined)")
    t.add_argument("--exhaustive", action="store_true",
                   help="measure the whole grid (within --budget) instead of pruning")
    t.add_argument("--output", "-o", default="deepnvme_aio.json", metavar="FILE",
                   help="where to write the DeepSpeed {\"aio\": ...} config (default: "
                        "deepnvme_aio.json); '-' to skip")
    t.add_argument("--plot", default=None, metavar="PNG", help="draw GB/s per configuration")
    t.add_argument("--force", action="store_true",
                   help="overwrite an existing --output or --plot file (default: refuse)")
    t.add_argument("--json", action="store_true", help="print JSON instead of tables")
    t.add_argument("--load", action="store_true",
                   help="measure only how loaders read on --dir's device (O_DIRECT or a mapping "
                        "through the page cache) and keep the faster for later loads")
    t.add_argument("--load-size", type=positive_size, default=1 << 30, metavar="SIZE",
                   help="--load: the probe file's size (default: 1G); every path loads it whole, "
                        "cold, in a fresh process")
    t.add_argument("--load-rounds", type=positive_int, default=3, metavar="N",
                   help="--load: loads of each path (default: 3; medians)")
    t.set_defaults(func=_cmd_tune)


def _cmd_load(args: Any) -> int:
    """``tune --load``: measure the load paths on --dir's device, cache and print the choice."""
    choice = measure_dir(args.dir, checkpoint_config(None), size=args.load_size, rounds=args.load_rounds)
    if args.json:
        print_json({**choice.to_dict(), "cache": cache_file()})
        return 0
    console = stdout_console()
    console.print(f"load paths on {choice.device} ({args.dir}): fresh loads {choice.fresh}, "
                  f"load_into {choice.into}")
    console.print(f"  {choice.reason}")
    console.print(f"  kept in {cache_file()} (the load_path setting overrides it)")
    return 0


def _cmd_tune(args: Any) -> int:
    if args.load:
        return _cmd_load(args)
    output = None if args.output == "-" else args.output
    if output is not None:  # fail before a long sweep, not after it
        check_writable(output, "--output", force=args.force)
    if args.plot:
        check_writable(args.plot, "--plot", force=args.force)
        require_matplotlib()
    space = load_space(args.space) if args.space else default_space()
    try:
        result = _run_with_progress(args, space, output)
    except TuneInterrupted as stop:
        _show(stop.result, args)
        saved = f"; the best so far is written to {output}" if output else ""
        print(f"deepnvme tune: interrupted{saved}", file=sys.stderr)
        return 130
    _show(result, args)
    return 0


def _run_with_progress(args: Any, space: TuneSpace, output: str | None) -> TuneResult:
    """run_tune with a progress bar of the budget spent."""
    with progress_bar("deepnvme tune (budget s)", args.budget) as progress:
        def on_trial(trial: Trial, seconds: float) -> None:
            if progress is not None:
                progress.advance(progress.task_ids[0], seconds)

        return run_tune(args.dir, space=space, io_size=args.io_size, loops=args.loops,
                        budget=args.budget, objective=args.objective,
                        exhaustive=args.exhaustive, output=output, on_trial=on_trial)


def _show(result: TuneResult, args: Any) -> None:
    """Draw --plot, then print the result as JSON or tables."""
    if args.plot:
        plot_tune(result, args.plot)
    if args.json:
        print_json(result.to_dict())
        return
    render_tune(result, stdout_console())
    if args.plot:
        stdout_console().print(f"  plot written to {args.plot}")


# --- rendering -------------------------------------------------------------------------

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
