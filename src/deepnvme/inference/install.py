"""``stream_weights``: move a model's block weights to NVMe and stream them back during forward."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from torch import nn

from .._deprecation import module_aliases
from ..config import IOConfig
from ..handles.aio import AioHandle
from ..io.volume import Volume
from ._blocks import ParamGroup, find_blocks, group_parameters, placeholder
from ._packed import write_packed
from ._quant import QuantSetting, packed_entries, plan_quantized, resolve_setting, split_bindings
from ._streamer import StreamedBlock, StreamStats, WeightStreamer

__all__ = ["stream_stats", "stream_weights", "streamer_of"]

log = logging.getLogger(__name__)
_ATTR = "_deepnvme_streamer"


def streamer_of(model: nn.Module) -> WeightStreamer:
    """The :class:`WeightStreamer` that :func:`stream_weights` or :func:`load_streamed` installed."""
    streamer = getattr(model, _ATTR, None)
    if not isinstance(streamer, WeightStreamer):
        raise ValueError(f"{type(model).__name__} streams no weights; build it with "
                         "deepnvme.inference.stream_weights or load_streamed first")
    return streamer


def stream_stats(model: nn.Module) -> StreamStats:
    """Counters of a model whose weights stream: blocks loaded, bytes read, seconds stalled on I/O."""
    return streamer_of(model).stats()


def resolve_blocks(model: nn.Module, blocks: Sequence[nn.Module] | None) -> list[tuple[str, nn.Module]]:
    if blocks is None:
        return find_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    missing = [type(b).__name__ for b in blocks if id(b) not in names]
    if missing:
        raise ValueError(f"blocks {missing} are not submodules of {type(model).__name__}")
    return [(names[id(b)], b) for b in blocks]


def install(model: nn.Module, streamed: list[StreamedBlock], *, device: torch.device,
            prefetch: int, pin_memory: bool, config: IOConfig | None) -> nn.Module:
    streamer = WeightStreamer(streamed, device=device, prefetch=prefetch,
                              pin_memory=pin_memory, config=config)
    object.__setattr__(model, _ATTR, streamer)
    return model


def _cpu_copy(param: torch.Tensor) -> torch.Tensor:
    return param.detach().cpu()


def _bytes_of(g: ParamGroup) -> int:
    return g.param.numel() * g.param.element_size()


def quant_plan(groups: list[ParamGroup], setting: QuantSetting | None) -> dict[str, tuple[int, int, bool]]:
    """The block's parameters stored quantised (linear weights), by name; see :func:`plan_quantized`."""
    return plan_quantized([(g.name, g.param, g.owners) for g in groups], setting)


def stream_weights(model: nn.Module, directory: str | Volume, *, device: str | torch.device = "cpu",
                   prefetch: int = 1, pin_memory: bool = True, config: IOConfig | None = None,
                   blocks: Sequence[nn.Module] | None = None, quantize: str | None = None,
                   group_size: int | None = None) -> nn.Module:
    """Write each block's weights to ``directory`` and stream them back while the model runs.

    ``blocks`` defaults to the model's repeated layers (the largest ``nn.ModuleList``); their
    parameters are written to ``directory/weights.bin`` (striped over the drives when
    ``directory`` is a :class:`~deepnvme.Volume`; one 4096-aligned region per block,
    durable: temp file, fsync, rename) and released from memory. Everything else (embeddings,
    head, norms, all buffers, weights tied outside a block) stays resident on ``device``.
    While the model runs, reads of the next ``prefetch`` blocks overlap the current block's
    compute; staging memory is ``(prefetch + 1) x`` the largest block. Blocking while writing.
    ``quantize="int8"`` or ``"int4"`` stores the blocks' linear weights group-quantised
    (``group_size`` inputs per scale, default 128, must divide each one's input dimension; scales
    in the weight's dtype), so a forward reads about a half or a quarter of the bytes and
    dequantises them into the weight's dtype; norms and biases stay as they are.
    Returns ``model`` (modified in place), to be called as usual (``model(...)``,
    ``model.generate(...)``).
    """
    if getattr(model, _ATTR, None) is not None:
        raise ValueError(f"{type(model).__name__} already streams its weights")
    setting = resolve_setting(quantize, group_size)
    dev = torch.device(device)
    named = resolve_blocks(model, blocks)
    per_block, resident = group_parameters(model, [n for n, _ in named])
    shapes = [quant_plan(groups, setting) for groups in per_block]   # checks group sizes first
    with torch.no_grad():
        for g in resident:
            g.param.data = g.param.data.to(dev)
        for mod in model.modules():
            for key, buf in mod._buffers.items():
                if buf is not None:
                    mod._buffers[key] = buf.to(dev)
    with AioHandle(config=config) as handle:
        plans = write_packed(directory, [
            [e for g in groups for e in packed_entries(g.name, _bytes_of(g), functools.partial(_cpu_copy, g.param),
                                                       shape.get(g.name), setting, g.param.dtype)]
            for groups, shape in zip(per_block, shapes)], handle=handle, setting=_record(setting, per_block))
    streamed = []
    for (_, module), groups, plan, shape in zip(named, per_block, plans, shapes):
        for g in groups:
            g.param.requires_grad_(False)
            g.param.data = placeholder(g.param.shape, g.param.dtype, dev)
        plain, quant = split_bindings([(g.name, g.param) for g in groups], plan.tensor_offsets, shape, setting)
        streamed.append(StreamedBlock(module, plan, plain, quant))
    log.info("deepnvme: wrote %d blocks (%d bytes) to %s to stream them", len(plans),
             sum(p.buffer_bytes for p in plans), directory)
    return install(model, streamed, device=dev, prefetch=prefetch, pin_memory=pin_memory, config=config)


def _record(setting: QuantSetting | None, per_block: list[list[ParamGroup]]) -> dict[str, object] | None:
    """The setting a packed folder records; the compute dtype is that of the first block weight."""
    if setting is None:
        return None
    first = next((g.param for groups in per_block for g in groups), None)
    return setting.record(first.dtype if first is not None else torch.float32)


__getattr__ = module_aliases(__name__, {"offload": "stream_weights"})
