"""What each rank runs in tests/distributed/test_offload_ranks.py (spawned, so module-level)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

import deepnvme
from deepnvme.offload._fsdp import fsdp_groups

VOCAB, DIM = 101, 48  # 101 rows: uneven shards (padding) on 2 and 4 ranks


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, 4 * DIM)
        self.down = torch.nn.Linear(4 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(self.norm(h))))


class TinyGPT(torch.nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h).flatten(0, 1)


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def shard(m: TinyGPT) -> TinyGPT:
    """One FSDP group per block, the root takes the rest; blocks prefetch the next forward."""
    for block in m.blocks:
        fully_shard(block)
    fully_shard(m)
    blocks: list[Any] = list(m.blocks)
    for a, b in zip(blocks, blocks[1:]):
        a.set_modules_to_forward_prefetch([b])
    return m


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int = 3) -> None:
    """``steps`` steps; the second accumulates two micro-batches (gradients added in the offload)."""
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        for _ in range(2 if step == 1 else 1):
            tokens = torch.randint(0, VOCAB, (2, 12), generator=gen)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # FSDP2 notes that the root returns a view
                torch.nn.functional.cross_entropy(m(tokens), tokens.flatten()).backward()
        opt.step()
        opt.zero_grad()


def local_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in sd.items()}


def record_all_gathers(m: torch.nn.Module) -> list[int]:
    """Wrap each FSDP group's unshard (outside the offload's wrapper) to record, by group index,
    the all-gathers FSDP issues, in its order."""
    seen: list[int] = []
    for i, g in enumerate(fsdp_groups(m)):
        inner = g.group.unshard

        def unshard(async_op: bool = False, *, _i: int = i, _g: Any = g.group, _inner: Any = inner) -> Any:
            if _g._all_gather_result is None and _g.is_sharded:
                seen.append(_i)
            return _inner(async_op)

        g.group.unshard = unshard
    return seen


def fsdp(rank: int, world: int, tmp: str) -> None:
    """FSDP2 + offload_parameters + NVMeOptimizer against FSDP2 + AdamW in memory: bitwise equal
    shards, each rank within its budget in its own directory, prefetch in FSDP's all-gather
    order; from_deepspeed_config (stage 3) sets up the same job."""
    base = shard(model())
    with pytest.raises(ValueError, match="no offload holds"):
        deepnvme.NVMeOptimizer(base.parameters(), swap_dir=os.path.join(tmp, "x"))
    train(base, torch.optim.AdamW(base.parameters(), lr=1e-2), rank)
    expected = local_state(base.state_dict())

    m = shard(model())
    with pytest.raises(ValueError, match="before fully_shard"):
        deepnvme.offload_parameters(m, os.path.join(tmp, "node"), max_in_memory_bytes=1 << 20, dtype=torch.float64)
    local_bytes = sum(p.to_local().numel() * 4 for p in m.parameters())
    budget = local_bytes // 2
    node = os.path.join(tmp, "node")  # every rank's "node-local" directory: the same one here
    off = deepnvme.offload_parameters(m, node, max_in_memory_bytes=budget, min_offload_bytes=1024)
    assert isinstance(m, FSDPModule)
    # train() accumulates in its second step: unfused (fuse_backward="auto" would fuse after a
    # clean first step, then refuse the second backward, as in one process)
    opt = deepnvme.NVMeOptimizer(m.parameters(), torch.optim.AdamW, swap_dir=node, lr=1e-2, fuse_backward=False)
    gathers = record_all_gathers(m)
    train(m, opt, rank)
    got = local_state(off.state_dict())
    assert got.keys() == expected.keys()
    bad = [k for k in got if not torch.equal(got[k], expected[k])]
    assert not bad, f"rank {rank}: {bad} differ from FSDP2 in memory"
    stats = off.stats()
    largest_grad = max(p.to_local().numel() * 4 for p in m.parameters())
    assert stats.peak_bytes <= budget + largest_grad, (stats, budget)
    assert stats.prefetch_hits > 0, stats
    # the learned order is FSDP's all-gather order (consecutive repeats merged), and the shards
    # in files are this rank's only
    passes = len(gathers) // 4
    one_pass = [g for i, g in enumerate(gathers[-passes:]) if i == 0 or g != gathers[-passes:][i - 1]]
    assert off._modules._order.learned == one_pass, (off._modules._order.learned, gathers)
    on_disk = sum(os.path.getsize(os.path.join(off.directory, f)) for f in os.listdir(off.directory))
    assert 0 < on_disk <= 2 * local_bytes + (64 << 10), on_disk
    dirs: list[Any] = [None] * world
    dist.all_gather_object(dirs, (off.directory, opt.swap_directory))
    assert len({d for pair in dirs for d in pair}) == 2 * world, dirs
    off.close()
    opt.close()

    settings = deepnvme.from_deepspeed_config(
        {
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 256,
                "offload_param": {
                    "device": "nvme",
                    "nvme_path": node,
                    "buffer_count": 2,
                    "buffer_size": local_bytes // 16,
                },
                "offload_optimizer": {"device": "nvme", "nvme_path": node},
            }
        }
    )
    m2 = model()
    off2, opt2 = settings.apply(m2, torch.optim.AdamW, lr=1e-2, fuse_backward=False)
    assert isinstance(m2, FSDPModule) and isinstance(opt2, deepnvme.NVMeOptimizer) and off2 is not None
    train(m2, opt2, rank)
    got2 = local_state(off2.state_dict())
    bad = [k for k in got2 if not torch.equal(got2[k], expected[k])]
    assert not bad, f"rank {rank}, from_deepspeed_config: {bad} differ"
    off2.close()
    opt2.close()


def ddp(rank: int, world: int, tmp: str) -> None:
    """Replicated parameters (DDP) with NVMeOptimizer: bitwise the same as AdamW, each rank's
    state in its own directory under the shared one."""
    torch.manual_seed(0)
    a = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)))
    torch.manual_seed(0)
    b = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)))
    node = os.path.join(tmp, "node")
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt_b = deepnvme.NVMeOptimizer(b.parameters(), torch.optim.AdamW, swap_dir=node, lr=1e-2, sub_group_bytes=4096)
    gen = torch.Generator().manual_seed(7 + rank)
    for _ in range(3):
        x = torch.randn(4, 32, generator=gen)
        for m, opt in ((a, opt_a), (b, opt_b)):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"rank {rank}: {name} differs"
    assert opt_b.num_sub_groups > 1 and opt_b.swapped_bytes > 0
    dirs: list[Any] = [None] * world
    dist.all_gather_object(dirs, opt_b.swap_directory)
    assert len(set(dirs)) == world and all(os.path.dirname(d) == node for d in dirs), dirs
    opt_b.close()


def fsdp_fused(rank: int, world: int, tmp: str, fuse: bool | str) -> None:
    """FSDP2 + offload + NVMeOptimizer with the update in the backward (FSDP2 runs the sharded
    parameters' post-accumulate-grad hooks after its reduce-scatter): bitwise equal to FSDP2 +
    AdamW in memory, no gradient written once fused; ``fuse="auto"`` fuses after the first
    step (watched: one reduced gradient per parameter)."""

    def steps(m: torch.nn.Module, opt: torch.optim.Optimizer, n: int, gen: torch.Generator) -> list[bool]:
        fused = []
        for _ in range(n):
            tokens = torch.randint(0, VOCAB, (2, 12), generator=gen)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # FSDP2 notes that the root returns a view
                torch.nn.functional.cross_entropy(m(tokens), tokens.flatten()).backward()
            opt.step()
            opt.zero_grad()
            fused.append(getattr(opt, "fuses_backward", False))
        return fused

    base = shard(model())
    steps(base, torch.optim.AdamW(base.parameters(), lr=1e-2), 5, torch.Generator().manual_seed(100 + rank))
    expected = local_state(base.state_dict())
    m = shard(model())
    node = os.path.join(tmp, "fused")
    local_bytes = sum(p.to_local().numel() * 4 for p in m.parameters())
    off = deepnvme.offload_parameters(m, node, max_in_memory_bytes=local_bytes // 2, min_offload_bytes=1024)
    opt = deepnvme.NVMeOptimizer(m.parameters(), torch.optim.AdamW, swap_dir=node, lr=1e-2, fuse_backward=fuse)
    gen = torch.Generator().manual_seed(100 + rank)
    assert opt.fuses_backward == (fuse is True), fuse  # "auto": watches the first step
    assert steps(m, opt, 3, gen) == [True, True, True], fuse
    before = off.stats().bytes_written
    steps(m, opt, 2, gen)  # fused in both modes now: the offloaded gradients are not written
    shards = sum(e.nbytes for e, _ in off._entries.values() if not e.resident)
    assert off.stats().bytes_written - before == 2 * shards, (off.stats(), shards)
    got = local_state(off.state_dict())
    bad = [k for k in got if not torch.equal(got[k], expected[k])]
    assert not bad, f"rank {rank}: {bad} differ from FSDP2 in memory"
    off.close()
    opt.close()
