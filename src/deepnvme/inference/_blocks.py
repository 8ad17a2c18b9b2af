"""Finding a model's repeated blocks and which parameters each block owns (tied ones included)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = ["ParamGroup", "find_blocks", "group_parameters"]


@dataclasses.dataclass
class ParamGroup:
    """One parameter object and every name it is reachable by (several when weights are tied)."""

    names: list[str]
    param: nn.Parameter
    owners: list[tuple[nn.Module, str]]

    @property
    def name(self) -> str:
        return self.names[0]


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks: the children of its ``nn.ModuleList`` holding the most
    parameters (the decoder layers of Llama, GPT-2 and OPT). Returns ``(name, module)`` pairs."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            size = sum(p.numel() for p in mod.parameters())
            if best is None or size > best[0]:
                best = (size, name, mod)
    if best is None or best[0] == 0:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of parameterised blocks; "
                         "pass blocks=[...] (the modules to stream) explicitly")
    _, name, mods = best
    return [(f"{name}.{i}" if name else str(i), m) for i, m in enumerate(mods)]


def group_parameters(model: nn.Module, block_names: list[str]
                     ) -> tuple[list[list[ParamGroup]], list[ParamGroup]]:
    """Split the parameters into per-block groups and resident ones.

    A parameter belongs to block ``b`` when every name it has lies inside ``b``; a parameter
    shared with anything outside its block (e.g. tied to the embeddings) stays resident.
    """
    groups: dict[int, ParamGroup] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            full = f"{mod_name}.{attr}" if mod_name else attr
            g = groups.get(id(p))
            if g is None:
                groups[id(p)] = ParamGroup([full], p, [(mod, attr)])
            else:
                if full not in g.names:
                    g.names.append(full)
                if not any(m is mod and a == attr for m, a in g.owners):
                    g.owners.append((mod, attr))
    per_block: list[list[ParamGroup]] = [[] for _ in block_names]
    resident: list[ParamGroup] = []
    prefixes = [n + "." for n in block_names]
    for g in groups.values():
        homes = {next((i for i, pre in enumerate(prefixes) if n.startswith(pre)), -1) for n in g.names}
        if len(homes) == 1 and -1 not in homes:
            per_block[homes.pop()].append(g)
        else:
            resident.append(g)
    return per_block, resident


def placeholder(shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
                device: torch.device | str) -> torch.Tensor:
    """A tensor of ``shape`` backed by one element (stride 0): what a streamed parameter holds
    between uses, so shapes and dtypes stay inspectable while the memory is released."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)
