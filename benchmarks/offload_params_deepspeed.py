"""DeepSpeed ZeRO-3 peer for bench_offload_params.py: the same model and loop, parameters and
optimizer state on NVMe through ``offload_param`` / ``offload_optimizer`` (device nvme), run in a
side environment that has DeepSpeed (``--ds-python``; DeepSpeed's CPU accelerator, gloo, one
rank, or the ranks of bench_offload_ranks.py). Parameter buffers: one per swapped parameter
(fewer assert), each of a rank's share of the largest parameter; aio block at most 1 MiB (a larger
one keeps every smaller tensor in memory).
DeepSpeed builds its async_io op on first use (TORCH_EXTENSIONS_DIR keeps it).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch
from offload_bench import status  # same folder

MIN_AIO_BYTES = 1 << 20  # DeepSpeed's floor for a swapped tensor (swap_tensor/utils.py)


def swapped_bytes(folder: str, rank: int) -> int:
    """Bytes of this rank's swap files under ``folder`` (DeepSpeed's .../rank<N>/ folders)."""
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(folder)
        if os.path.basename(root) == f"rank{rank}"
        for f in files
    )


def run_deepspeed(
    args: argparse.Namespace,
    make_model: Callable[[int, int], torch.nn.Module],
    time_steps: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    for k, v in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29517"),
    ):
        os.environ.setdefault(k, v)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # the side environment's (--ds-python)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warm = torch.nn.Linear(64, 64)
    torch.optim.AdamW(warm.parameters()).step(warm(torch.randn(8, 64)).sum().backward())
    deepspeed.init_distributed(dist_backend="gloo")
    baseline = status("VmRSS")
    largest = args.dim * args.dim
    budget_elems = int(args.budget_mib * 2**20) // 4
    min_offload = 64 << 10 if args.min_offload_bytes is None else args.min_offload_bytes
    persist_elems = min_offload // 4  # fp32: parameters of fewer bytes than min_offload
    world = torch.distributed.get_world_size()
    swapped = args.layers  # the Linear weights; the biases persist (under persist_elems)
    nvme = os.path.join(args.dir, "deepspeed")
    os.makedirs(nvme, exist_ok=True)
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {
            "stage": 3,
            # one buffer of a rank's share of the largest parameter per parameter it swaps: with
            # fewer (the budget's worth, 2 here) the first forward asserts "Not enough buffers 0
            # for swapping 1" (as in bench_offload_gpt.py), so DeepSpeed holds more than the budget
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme,
                "pin_memory": False,
                "buffer_size": -(-largest // world),
                "buffer_count": max(2, budget_elems // largest, swapped + 2),
                "max_in_cpu": 0,
            },
            # buffer_count 4 (its default): with 3, ZeRO-3's optimizer swapper runs out of
            # buffers for Adam (parameter, two moments, gradient) and asserts
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme,
                "pin_memory": False,
                "buffer_count": max(4, args.buffers),
            },
            # the parameters deepnvme keeps in memory (min_offload_bytes, at most an eighth of
            # the budget with their gradients) persist in DeepSpeed too
            "stage3_param_persistence_threshold": persist_elems,
            "stage3_model_persistence_threshold": budget_elems // 16,
            "stage3_max_live_parameters": budget_elems,
            "stage3_prefetch_bucket_size": budget_elems // 4,
            "sub_group_size": budget_elems // 4,
        },
        # DeepSpeed swaps a partition (parameter or optimizer sub-group) only when it holds at
        # least max(1 MiB, aio block_size) bytes and keeps smaller ones in memory without a word
        # (swap_tensor: min_aio_bytes): with an 8 MiB block, a Linear(1024)'s 4 MiB (2 MiB per
        # rank of two) stayed in memory and nothing reached the disk. Its block is therefore at
        # most 1 MiB (its default), and the run reports what its swap folders hold.
        "aio": {
            "block_size": min(args.block_size, MIN_AIO_BYTES),
            "queue_depth": 32,
            "thread_count": args.io_threads,
            "single_submit": False,
            "overlap_events": True,
        },
    }
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme"):
        model = make_model(args.layers, args.dim)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(1))

    def step() -> None:
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()

    out = time_steps(step, args.steps, baseline)
    return {
        "mode": "deepspeed",
        "n_params": args.layers * (args.dim * args.dim + args.dim),
        "deepspeed": deepspeed.__version__,
        "swap_folder_bytes": swapped_bytes(nvme, torch.distributed.get_rank()),
        **out,
    }
