"""``deepnvme generate``: time greedy generation of a model whose weights stream from NVMe.

The lead registers it with ``add_generate_parser(subparsers)`` in ``cli/main.py``; the parser
sets ``func`` to :func:`_generate`, which calls :func:`run_generate` and renders its result.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

import torch

from ..config import resolve_config
from ..errors import UsageError
from ..inference.generate import GenerateResult, parse_dtype, run_generate
from ._args import nonnegative_int, positive_int, positive_size

__all__ = ["GenerateResult", "add_generate_parser", "run_generate"]

_DESCRIPTION = ("Time greedy generation (prefill and decode tokens/s, bytes read, peak RSS, "
                "overlap) of a local transformers checkpoint whose decoder layers stream from "
                "disk.")


def _dtype(text: str) -> str:
    """--dtype: a name parse_dtype knows, checked when parsed."""
    try:
        parse_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _check_model(path: str) -> None:
    """--model must be a local checkpoint folder: hub ids are not downloaded."""
    if not os.path.isdir(path):
        raise UsageError(f"--model {path!r} is not a local folder; give the folder of a "
                         "transformers checkpoint (config.json + *.safetensors). Hub ids are "
                         "not downloaded: fetch it first, e.g. 'hf download ID --local-dir DIR'")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"--model {path!r} has no config.json; give the folder of a "
                         "transformers checkpoint (config.json + *.safetensors)")


def _check_device(device: str) -> None:
    """--device must parse and, for CUDA, exist here."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device} needs CUDA, but torch.cuda.is_available() is "
                             f"False (torch {torch.__version__}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA "
                             "device(s) exist")
    elif dev.type != "cpu":
        raise UsageError(f"--device {device!r}: only cpu and cuda are supported")


def _require_transformers() -> None:
    """generate builds the model with transformers and accelerate (the inference extra)."""
    try:
        for name in ("transformers", "accelerate"):
            importlib.import_module(name)
    except ImportError as exc:
        raise UsageError(f"generate needs transformers and accelerate ({exc.name or exc} is "
                         "missing): pip install 'deepnvme[inference]'") from None


def _packed_dir(args: argparse.Namespace) -> str | None:
    """--packed-dir, or the deprecated --offload-dir (kept one release, with a note on stderr)."""
    packed: str | None = args.packed_dir
    old: str | None = args.offload_dir
    if old is None:
        return packed
    if packed is not None:
        raise UsageError("give --packed-dir only: --offload-dir is its deprecated old name")
    print("deepnvme generate: --offload-dir is deprecated and will be removed in the next "
          "release; use --packed-dir", file=sys.stderr)
    return old


def _generate(args: argparse.Namespace) -> int:
    packed_dir = _packed_dir(args)
    if args.quantize is not None and args.mode != "deepnvme":
        raise UsageError("--quantize stores streamed weights quantised: it needs --mode deepnvme")
    if args.quantize is not None and packed_dir is None:
        raise UsageError(f"--quantize {args.quantize} writes a quantised copy of the weights: give --packed-dir DIR")
    if args.group_size is not None and args.quantize is None:
        raise UsageError("--group-size applies only with --quantize int8 or int4")
    _check_model(args.model)
    _check_device(args.device)
    _require_transformers()
    cfg = resolve_config({"block_size": args.block_size, "queue_depth": args.queue_depth,
                          "intra_op_parallelism": args.parallelism})
    result = run_generate(args.model, packed_dir=packed_dir, mode=args.mode,
                          batch_size=args.batch_size, prompt_len=args.prompt_len,
                          gen_len=args.gen_len, prefetch=args.prefetch, device=args.device,
                          dtype=args.dtype, pin_memory=not args.no_pin_memory, config=cfg,
                          seed=args.seed, quantize=args.quantize, group_size=args.group_size)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.render())
    return 0


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    g: argparse.ArgumentParser = subparsers.add_parser(
        "generate", help="time greedy generation with weights streamed from disk", description=_DESCRIPTION)
    g.add_argument("--model", required=True, metavar="DIR",
                   help="local transformers checkpoint folder (config.json + safetensors)")
    g.add_argument("--packed-dir", default=None, metavar="DIR",
                   help="folder for an aligned copy of the weights (prepared once); default: "
                        "stream straight from the checkpoint files")
    g.add_argument("--offload-dir", default=None, help=argparse.SUPPRESS)  # old name of --packed-dir
    g.add_argument("--mode", choices=("deepnvme", "memory"), default="deepnvme",
                   help="deepnvme: stream block weights; memory: load the whole model (baseline)")
    g.add_argument("--batch-size", type=positive_int, default=1, metavar="N",
                   help="prompts generated together (default: 1)")
    g.add_argument("--prompt-len", type=positive_int, default=32, metavar="N",
                   help="tokens per random prompt (default: 32)")
    g.add_argument("--gen-len", type=positive_int, default=16, metavar="N",
                   help="new tokens per prompt (default: 16)")
    g.add_argument("--prefetch", type=nonnegative_int, default=1, metavar="N",
                   help="blocks read ahead while one computes (default: 1)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    g.add_argument("--dtype", type=_dtype, default=None,
                   help="float32, bfloat16 or float16 (default: the checkpoint's)")
    g.add_argument("--quantize", choices=("int8", "int4"), default=None,
                   help="store the streamed linear weights group-quantised in --packed-dir and "
                        "dequantise them as each layer runs (default: as the checkpoint stores them)")
    g.add_argument("--group-size", type=positive_int, default=None, metavar="N",
                   help="inputs per quantisation scale; must divide each linear layer's input "
                        "size (default: 128)")
    g.add_argument("--no-pin-memory", action="store_true", help="plain (unlocked) staging buffers")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default: 0)")
    g.add_argument("--block-size", type=positive_size, default=None, metavar="SIZE",
                   help="bytes per read chunk, K/M/G suffixes (default: 1M or DEEPNVME_BLOCK_SIZE)")
    g.add_argument("--queue-depth", type=positive_int, default=None, metavar="N",
                   help="chunks in flight per handle (default: 128)")
    g.add_argument("--parallelism", type=positive_int, default=None, metavar="N",
                   help="I/O threads per handle, intra_op_parallelism (default: 1)")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g.set_defaults(func=_generate)
    return g
