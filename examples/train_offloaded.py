"""Train a small transformer with its parameters, gradients and optimizer state on NVMe.

    python examples/train_offloaded.py --dir /mnt/nvme/offload --layers 8 --dim 512 --steps 50

The model is built on the meta device and initialised tensor by tensor straight into files
(it never exists whole in memory); each step reads every layer's parameters for the forward
and the backward, writes gradients as they are produced, and the optimizer reads parameters,
gradients and Adam state per sub-group and writes them back. The memory budget defaults to a
quarter of the parameters' bytes; the end prints what was held and moved.
"""

from __future__ import annotations

import argparse
import math
import resource
import shutil
import tempfile
import time

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

import deepnvme


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def init(name: str, t: torch.Tensor) -> None:
    """GPT-2 style: normal(0, 0.02) weights, zero biases, unit LayerNorm scales."""
    if name.endswith("bias"):
        t.zero_()
    elif t.dim() == 1:
        t.fill_(1.0)
    else:
        t.normal_(0.0, 0.02)


def batch(vocab: int, size: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences (start random, step 1 mod vocab): learnable, so the loss falls."""
    start = torch.randint(0, vocab, (size, 1), generator=gen)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", help="where the files go (default: a temporary directory)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--budget-mib", type=float, help="memory for parameters and gradients "
                   "(default: a quarter of the parameters' bytes)")
    args = p.parse_args()
    console = Console()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyGPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    param_bytes = sum(t.numel() * 4 for t in model.parameters())
    largest_layer = max(sum(t.numel() * 4 for t in m.parameters(recurse=False)) for m in model.modules())
    budget = (int(args.budget_mib * 2**20) if args.budget_mib
              else max(param_bytes // 4, 4 * largest_layer))
    directory = args.dir or tempfile.mkdtemp(prefix="deepnvme-train-")
    offload = deepnvme.offload_parameters(model, directory, max_in_memory_bytes=budget, source=init)
    opt = deepnvme.NVMeOptimizer(model.parameters(), torch.optim.AdamW, swap_dir=directory, lr=3e-3)
    console.print(f"{param_bytes / 2**20:.2f} MiB of parameters (x4 with gradients and Adam "
                  f"state) on {directory}; budget {budget / 2**20:.2f} MiB")
    gen = torch.Generator().manual_seed(1)
    columns = (TextColumn("step {task.completed}/{task.total}"), BarColumn(),
               TextColumn("loss {task.fields[loss]:.3f}  {task.fields[rate]:.2f} s/step"),
               TimeRemainingColumn())
    first = last = math.nan
    begin = time.perf_counter()
    try:
        with Progress(*columns, console=console, transient=False) as bar:
            task = bar.add_task("train", total=args.steps, loss=math.nan, rate=0.0)
            for step in range(args.steps):
                opt.zero_grad()
                for _ in range(args.accum):
                    x, y = batch(args.vocab, args.batch, args.seq, gen)
                    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                    (loss / args.accum).backward()
                opt.step()
                last = loss.item()
                first = last if step == 0 else first
                bar.update(task, advance=1, loss=last,
                           rate=(time.perf_counter() - begin) / (step + 1))
        s = offload.stats()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        console.print(f"loss {first:.3f} -> {last:.3f}; parameters+gradients held at most "
                      f"{s.peak_bytes / 2**20:.2f} MiB of {budget / 2**20:.2f} MiB; read "
                      f"{s.bytes_read / 2**20:.0f} MiB, wrote {s.bytes_written / 2**20:.0f} MiB; "
                      f"peak RSS {rss:.0f} MiB")
    finally:
        offload.close()
        opt.close()
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
