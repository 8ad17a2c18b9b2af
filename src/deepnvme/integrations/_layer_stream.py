"""A serving framework's model with its decoder layers' weights streamed from NVMe while it runs.

Framework-free (vLLM's ``deepnvme_stream`` loader drives it): the caller built the model with
its parameters allocated but untouched and passes its ``load_weights(iterable of (name,
tensor)) -> loaded names``. Non-layer weights (embeddings, final norm, head) are loaded and stay
in memory; then as many whole layers as ``memory_budget`` leaves room for (spread evenly over
the stack). Every layer is written once, in the framework's post-load layout (e.g. vLLM's fused
``qkv_proj``), to ``packed_dir`` in :mod:`deepnvme.inference`'s packed aligned layout, reused
while the checkpoint and the model's parameters are unchanged; the layers not kept in memory are
then streamed by :class:`deepnvme.inference.WeightStreamer` (forward pre-hooks, ``prefetch``
layers read ahead, buffers released after each layer).

Memory: resident weights (at most ``memory_budget``, beyond the non-layer weights which must fit
in it) plus ``(prefetch + 1) x largest streamed layer`` of staging buffers; while the aligned copy
is written, one layer, one write buffer of the same size and the reader's two read windows more.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._deprecation import warn_once
from ..errors import ConfigError, DeepNVMeError
from ..formats.safetensors import StoredTensor
from ..handles.aio import AioHandle
from ..inference._blocks import ParamGroup, group_parameters, placeholder
from ..inference._layout import BlockPlan
from ..inference._packed import load_manifest, source_stats, write_packed
from ..inference._quant import QuantSetting, packed_entries, resolve_setting, split_bindings
from ..inference._streamer import StreamedBlock
from ..inference.install import install, quant_plan, resolve_blocks
from ..io.volume import Volume
from ._weights import LoaderOptions, checkpoint_tensors, loader_options, size_setting, stream_tensors

__all__ = ["STREAM_KEYS", "LayerStreamResult", "StreamOptions", "assign_tensors", "choose_resident",
           "stream_layers", "stream_options"]

log = logging.getLogger(__name__)

Load = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
"""The framework's ``model.load_weights``: consumes ``(name, tensor)`` pairs, returns loaded names."""

STREAM_KEYS: Mapping[str, str] = {
    "packed_dir": "directory for the aligned copy of the layers' weights (required; written "
                   "once, reused while the checkpoint is unchanged); a list of directories, one "
                   "per drive, stripes it over them",
    "quantize": "store the streamed layers' linear weights group-quantised: 'int8' or 'int4' "
                "(read at a half or a quarter of the bytes, dequantised as each layer runs); "
                "default: as they are",
    "group_size": "inputs per quantisation scale (default 128; must divide each linear "
                  "weight's input dimension)",
    "memory_budget": "bytes of weights kept in memory (int or size string such as '2G'): the "
                     "non-layer weights, then whole layers while they fit; default: no layer",
    "prefetch": "layers read ahead of the one computing (int >= 0, default 1); staging memory is "
                "(prefetch + 1) x the largest streamed layer",
}
"""Extra-config keys of the streaming loader; the others are those of :func:`loader_options`."""

OLD_KEYS: Mapping[str, str] = {"offload_dir": "packed_dir"}
"""Keys renamed in this release, still accepted with a warning: old -> new."""


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """Validated settings: where the aligned copy lives, the budget in bytes (None: keep no
    layer), read-ahead depth, and the checkpoint reader's I/O settings and read window."""

    packed_dir: str | Volume
    memory_budget: int | None
    prefetch: int
    loader: LoaderOptions
    quant: QuantSetting | None = None   # streamed layers' linear weights stored quantised


def stream_options(extra: Mapping[str, Any] | None, *, load_format: str,
                   source: str = "model_loader_extra_config") -> StreamOptions:
    """Check ``extra`` (vLLM's ``model_loader_extra_config``): :data:`STREAM_KEYS` plus the keys
    of :func:`loader_options`, and the old names of :data:`OLD_KEYS` (with a warning). A missing
    ``packed_dir``, an unknown key or a bad value raises :class:`ConfigError` naming ``source``
    and the key."""
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(f"{source} must be a JSON object (a dict), got {type(extra).__name__}")
    rest = _renamed_keys(dict(extra or {}), source)
    directory = rest.pop("packed_dir", None)
    if isinstance(directory, list) and directory and all(isinstance(d, str) and d for d in directory):
        directory = Volume(directory)   # one directory per drive: the copy striped over them
    elif not isinstance(directory, str) or not directory:
        raise ConfigError(f"{source}['packed_dir'] is required for load_format {load_format!r}: a "
                          f"directory on fast storage for the layers' aligned copy (or a list of "
                          f"directories, one per drive), got {directory!r}")
    budget = None
    if "memory_budget" in rest:
        budget = size_setting(source, "memory_budget", rest.pop("memory_budget"), minimum=0)
    prefetch = rest.pop("prefetch", 1)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ConfigError(f"{source}['prefetch'] must be an integer >= 0, got {prefetch!r}")
    try:
        quant = resolve_setting(rest.pop("quantize", None), rest.pop("group_size", None))
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc} (keys 'quantize', 'group_size')") from None
    loader = loader_options(rest, source=source, load_format=load_format, also_known=STREAM_KEYS)
    return StreamOptions(packed_dir=directory, memory_budget=budget, prefetch=prefetch, loader=loader,
                         quant=quant)


def _renamed_keys(extra: dict[str, Any], source: str) -> dict[str, Any]:
    """``extra`` with each old key of :data:`OLD_KEYS` under its new name, warning once per key."""
    for old, new in OLD_KEYS.items():
        if old not in extra:
            continue
        if new in extra:
            raise ConfigError(f"{source} has both {old!r} and {new!r}; keep {new!r} only "
                              f"({old!r} is its deprecated old name)")
        message = (f"{source}[{old!r}] is deprecated and will be removed in the next release; "
                   f"use {new!r}")
        if warn_once(f"{source}[{old!r}]", message, stacklevel=3):
            log.warning("deepnvme: %s", message)   # serving logs show this; warnings often not
        extra[new] = extra.pop(old)
    return extra


def assign_tensors(tensors: Sequence[StoredTensor], block_names: Sequence[str]
                   ) -> tuple[list[list[StoredTensor]], list[StoredTensor]]:
    """Split checkpoint ``tensors`` by the layer whose module name prefixes theirs
    (``model.layers.3.`` for ``model.layers.3``); the rest are non-layer tensors. Order kept. Pure."""
    index = {name + ".": i for i, name in enumerate(block_names)}
    per_block: list[list[StoredTensor]] = [[] for _ in block_names]
    rest: list[StoredTensor] = []
    for t in tensors:
        parts = t.name.split(".")
        home = next((index[p] for p in (".".join(parts[:k]) + "." for k in range(1, len(parts)))
                     if p in index), None)
        (rest if home is None else per_block[home]).append(t)
    return per_block, rest


def choose_resident(block_bytes: Sequence[int], room: int) -> list[int]:
    """Indices of the layers kept in memory: as many as fit in ``room`` bytes, spread evenly over
    the stack (a resident layer's compute then hides the next streamed layer's read). Pure."""
    order = sorted(range(len(block_bytes)), key=lambda i: block_bytes[i])
    count, used = 0, 0
    for i in order:
        if used + block_bytes[i] > room:
            break
        used += block_bytes[i]
        count += 1
    if count == 0:
        return []
    n = len(block_bytes)
    spread = sorted({(2 * j + 1) * n // (2 * count) for j in range(count)})
    if len(spread) == count and sum(block_bytes[i] for i in spread) <= room:
        return spread
    return sorted(order[:count])   # uneven layers: the smallest ones


@dataclasses.dataclass(frozen=True)
class LayerStreamResult:
    """What :func:`stream_layers` did: which layers stream and which stay, their bytes, the
    staging memory, whether the aligned copy was written now, and the names ``load`` loaded."""

    streamed: tuple[int, ...]
    resident: tuple[int, ...]
    streamed_bytes: int
    resident_bytes: int
    staging_bytes: int
    converted: bool
    loaded: frozenset[str]


def _nbytes(g: ParamGroup) -> int:
    return g.param.numel() * g.param.element_size()


class _Layers:
    """Materialises one layer at a time through ``load`` and releases it again."""

    def __init__(self, groups: list[list[ParamGroup]], tensors: list[list[StoredTensor]], load: Load,
                 options: LoaderOptions, keep: set[int], names: Sequence[str]) -> None:
        self.groups, self.tensors, self.load, self.options = groups, tensors, load, options
        self.keep, self.names = keep, names
        self.current = -1
        self.loaded: set[str] = set()

    def release(self, i: int) -> None:
        for g in self.groups[i]:
            g.param.data = placeholder(g.param.shape, g.param.dtype, g.param.device)

    def fill(self, i: int) -> None:
        if self.current >= 0 and self.current not in self.keep:
            self.release(self.current)
        for g in self.groups[i]:
            g.param.data = torch.empty(g.param.shape, dtype=g.param.dtype, device=g.param.device)
        self.current = i
        got = _loaded_names(self.load(stream_tensors(self.tensors[i], self.options)))
        missing = [g.name for g in self.groups[i] if not got & set(g.names)]
        if missing:
            raise DeepNVMeError(f"layer {self.names[i]}: the checkpoint tensors named "
                                f"'{self.names[i]}.*' did not load {missing[:4]}: the checkpoint "
                                "lacks them, or names them otherwise (streaming needs checkpoint "
                                "names that start with the layer's module name)")
        self.loaded |= got

    def tensor(self, i: int, g: ParamGroup) -> torch.Tensor:
        if i != self.current:
            self.fill(i)
        return g.param.data


def _loaded_names(names: Any) -> set[str]:
    if names is None:
        raise DeepNVMeError("the model's load_weights returned no parameter names, which "
                            "streaming needs to check every layer was loaded")
    return set(names)


def stream_layers(model: nn.Module, model_dir: str, options: StreamOptions, *, load: Load,
                  fingerprint: Mapping[str, Any], blocks: Sequence[nn.Module] | None = None
                  ) -> LayerStreamResult:
    """Load ``model``'s weights from the safetensors checkpoint in ``model_dir`` through ``load``,
    keeping the layers the budget allows and streaming the others from ``options.packed_dir``.

    ``blocks`` defaults to the largest ``nn.ModuleList`` (the decoder layers); ``fingerprint``
    (JSON) names what else the aligned copy depends on (framework version, parallel rank, ...).
    Blocking. Parameters of streamed layers are 1-element placeholders between their uses.
    """
    named = resolve_blocks(model, blocks)
    names = [n for n, _ in named]
    groups, rest_groups = group_parameters(model, names)
    by_block, rest = assign_tensors(checkpoint_tensors(model_dir), names)
    sizes = [sum(_nbytes(g) for g in gs) for gs in groups]
    fixed = sum(_nbytes(g) for g in rest_groups)
    budget = options.memory_budget
    if budget is not None and fixed > budget:
        raise ConfigError(f"model_loader_extra_config['memory_budget'] = {budget} bytes is below the "
                          f"weights that always stay in memory (embeddings, norms, head: {fixed} bytes)")
    keep = choose_resident(sizes, budget - fixed) if budget is not None else []
    layers = _Layers(groups, by_block, load, options.loader, set(keep), names)
    for i in range(len(groups)):
        layers.release(i)   # untouched memory: what the layers load later reuses it
    try:
        loaded = _loaded_names(load(stream_tensors(rest, options.loader)))
    except RuntimeError as exc:   # a tensor outside every layer's prefix went into a released layer
        raise DeepNVMeError(f"{model_dir}: loading the non-layer tensors failed ({exc}); streaming "
                            "needs checkpoint names that start with the layers' module names, e.g. "
                            f"{names[0]!r}.*") from exc
    streamed = [i for i in range(len(groups)) if i not in layers.keep]
    if not streamed:
        for i in keep:
            layers.fill(i)
        log.info("deepnvme: every layer fits in memory_budget=%d; nothing is streamed", budget)
        return _result(streamed, keep, sizes, 0, False, loaded | layers.loaded)
    # every layer's copy is stored alike (the kept ones too: which layers are kept follows the
    # budget, the copy does not), kept layers being used from memory at full precision
    shapes = [quant_plan(gs, options.quant) for gs in groups]
    plans, converted = _aligned_copy(layers, options, _fingerprint(by_block, rest, groups, fingerprint), shapes)
    if not converted:
        for i in keep:
            layers.fill(i)
        loaded |= {n for i in streamed for g in groups[i] for n in g.names}
    loaded |= layers.loaded
    stream = [StreamedBlock(named[i][1], plans[i], *split_bindings(
        [(g.name, g.param) for g in groups[i]], plans[i].tensor_offsets, shapes[i], options.quant))
        for i in streamed]
    device = next(iter(model.parameters())).device
    install(model, stream, device=device, prefetch=options.prefetch, pin_memory=True,
            config=options.loader.io)
    staging = (min(options.prefetch, len(streamed) - 1) + 1) * max(plans[i].buffer_bytes for i in streamed)
    return _result(streamed, keep, sizes, staging, converted, loaded)


def _fingerprint(by_block: list[list[StoredTensor]], rest: list[StoredTensor],
                 groups: list[list[ParamGroup]], extra: Mapping[str, Any]) -> dict[str, Any]:
    files = [t.file for ts in [rest, *by_block] for t in ts]
    layout = [[[g.name, list(g.param.shape), str(g.param.dtype)] for g in gs] for gs in groups]
    return {"files": source_stats(files), "layers": layout, **extra}


def _aligned_copy(layers: _Layers, options: StreamOptions, fingerprint: dict[str, Any],
                  shapes: list[dict[str, tuple[int, int, bool]]]) -> tuple[list[BlockPlan], bool]:
    """The layers' plans in the aligned copy: reused if its manifest matches ``fingerprint``
    and the quantisation setting, else written now (every layer loaded once, in order; kept
    layers stay loaded; ``shapes``: per layer, the weights stored quantised)."""
    first = next((g.param.dtype for gs in layers.groups for g in gs), torch.float32)
    setting = None if options.quant is None else options.quant.record(first)
    plans = load_manifest(options.packed_dir, fingerprint, setting)
    if plans is not None and len(plans) == len(layers.groups):
        log.info("deepnvme: reusing the aligned layer copy in %s", options.packed_dir)
        return plans, False
    with AioHandle(config=options.loader.io) as handle:
        plans = write_packed(options.packed_dir, [
            [e for g in gs for e in packed_entries(g.name, _nbytes(g), functools.partial(layers.tensor, i, g),
                                                   shapes[i].get(g.name), options.quant, g.param.dtype)]
            for i, gs in enumerate(layers.groups)], handle=handle, fingerprint=fingerprint, setting=setting)
    if layers.current not in layers.keep:
        layers.release(layers.current)
    log.info("deepnvme: wrote the aligned layer copy to %s", options.packed_dir)
    return plans, True


def _result(streamed: list[int], keep: list[int], sizes: list[int], staging: int, converted: bool,
            loaded: set[str]) -> LayerStreamResult:
    return LayerStreamResult(streamed=tuple(streamed), resident=tuple(keep),
                             streamed_bytes=sum(sizes[i] for i in streamed),
                             resident_bytes=sum(sizes[i] for i in keep), staging_bytes=staging,
                             converted=converted, loaded=frozenset(loaded))
