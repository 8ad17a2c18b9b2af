"""``load_streamed``: a transformers model whose block weights stream from its checkpoint.

The model is built with parameters on the meta device (buffers real), so no weight is
materialised; resident weights (embeddings, head, norms) are read once, block weights are
streamed at every forward either straight from the ``*.safetensors`` files (4096-aligned
spans, O_DIRECT) or from an aligned copy in ``packed_dir`` prepared once (needed when the
requested dtype differs from the checkpoint's, or when weights are stored quantised).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
from typing import Any

import torch
from torch import nn

from .._deprecation import module_aliases, renamed_keywords
from ..config import IOConfig
from ..errors import DeepNVMeError
from ..handles.aio import AioHandle
from ..io.volume import Volume
from ._blocks import ParamGroup, group_parameters, placeholder
from ._layout import BlockPlan, TensorRecord, plan_block_reads
from ._packed import load_manifest, source_stats, write_packed
from ._quant import QuantSetting, packed_entries, resolve_setting, split_bindings
from ._safetensors import CheckpointTensor, read_checkpoint_index
from ._streamer import StreamedBlock
from .install import install, quant_plan, resolve_blocks

__all__ = ["load_streamed"]

log = logging.getLogger(__name__)


def _build_empty(pretrained_dir: str, dtype: torch.dtype, model_class: Any) -> nn.Module:
    try:
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise ImportError("load_streamed needs transformers and accelerate: "
                          "pip install 'deepnvme[inference]'") from exc
    hf_config = AutoConfig.from_pretrained(pretrained_dir)
    cls = model_class or AutoModelForCausalLM
    with init_empty_weights(include_buffers=False):
        model: nn.Module = cls.from_config(hf_config, dtype=dtype)
    # Tie outside the context: its register_parameter patch would copy the shared parameter.
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()   # e.g. GPT-2's lm_head, not tied when built on meta
    return model.eval()


def _lookup(g: ParamGroup, index: dict[str, CheckpointTensor], prefix: str) -> CheckpointTensor | None:
    for name in g.names:
        for cand in (name, name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else None,
                     f"{prefix}.{name}" if prefix else None):
            if cand is not None and cand in index:
                return index[cand]
    return None


def _read_as(handle: AioHandle, rec: CheckpointTensor, dtype: torch.dtype) -> torch.Tensor:
    return _read(handle, rec).to(dtype)


def _read(handle: AioHandle, rec: CheckpointTensor) -> torch.Tensor:
    out = torch.empty(rec.shape, dtype=rec.dtype)
    handle.submit_read(out, rec.file, offset=rec.offset).result()
    return out


def _replace(g: ParamGroup, tensor: torch.Tensor) -> nn.Parameter:
    """Put a fresh parameter holding ``tensor`` wherever the (meta) parameter of ``g`` was."""
    p = nn.Parameter(tensor, requires_grad=False)
    for mod, attr in g.owners:
        mod._parameters[attr] = p
    g.param = p
    return p


def _default_dtype(index: dict[str, CheckpointTensor]) -> torch.dtype:
    counts = collections.Counter(r.dtype for r in index.values() if r.dtype.is_floating_point)
    return counts.most_common(1)[0][0] if counts else torch.float32


def _fingerprint(index: dict[str, CheckpointTensor], dtype: torch.dtype, names: list[list[str]]) -> Any:
    return {"files": source_stats(r.file for r in index.values()), "dtype": str(dtype), "blocks": names}


def _record(setting: QuantSetting | None, dtype: torch.dtype) -> dict[str, Any] | None:
    return None if setting is None else setting.record(dtype)


@renamed_keywords(offload_dir="packed_dir")
def load_streamed(pretrained_dir: str, *, packed_dir: str | Volume | None = None,
                  device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                  prefetch: int = 1, pin_memory: bool = True, config: IOConfig | None = None,
                  model_class: Any = None, quantize: str | None = None,
                  group_size: int | None = None) -> nn.Module:
    """Build the causal LM saved in ``pretrained_dir`` (``config.json`` + safetensors) with its
    block weights streamed from disk; blocking while resident weights are read.

    ``dtype`` defaults to the checkpoint's. Without ``packed_dir`` blocks stream straight from
    the checkpoint files (their dtype must then equal ``dtype``); with it, an aligned copy is
    written there once (reused while the checkpoint is unchanged) and streamed instead; a
    :class:`~deepnvme.Volume` stripes the copy over its drives, each block read from all of them.
    ``model_class`` overrides ``AutoModelForCausalLM`` (any class with ``from_config``).
    ``quantize="int8"`` or ``"int4"`` (needs ``packed_dir``) stores the blocks' linear weights
    group-quantised in the copy (``group_size`` inputs per scale, default 128; scales in
    ``dtype``) and dequantises them into ``dtype`` as each block runs. The copy records its
    setting; a copy made with another setting is rewritten, never read as this one.
    Peak memory: resident weights plus ``(prefetch + 1)`` blocks.
    """
    setting = resolve_setting(quantize, group_size)
    if setting is not None and packed_dir is None:
        raise ValueError(f"quantize={quantize!r} stores a quantised copy of the weights: pass packed_dir=")
    index = read_checkpoint_index(pretrained_dir)
    dtype = dtype or _default_dtype(index)
    dev = torch.device(device)
    model = _build_empty(pretrained_dir, dtype, model_class)
    prefix = getattr(model, "base_model_prefix", "")
    named = resolve_blocks(model, None)
    per_block, resident = group_parameters(model, [n for n, _ in named])
    shapes = [quant_plan(groups, setting) for groups in per_block]   # checks group sizes first
    with AioHandle(config=config) as handle:
        missing = [g.name for gs in [resident, *per_block] for g in gs if _lookup(g, index, prefix) is None]
        if missing:
            raise DeepNVMeError(f"{pretrained_dir}: checkpoint lacks {len(missing)} parameters "
                                f"of {type(model).__name__}, e.g. {missing[:5]}")
        for g in resident:
            _replace(g, _read(handle, _lookup(g, index, prefix)).to(dev, dtype))  # type: ignore[arg-type]
        for mod_name, mod in model.named_modules():
            for key, buf in list(mod._buffers.items()):
                if buf is None:
                    continue
                rec = index.get(f"{mod_name}.{key}")   # persistent buffers saved in the checkpoint
                if rec is not None:
                    buf = _read(handle, rec).to(buf.dtype)
                mod._buffers[key] = buf.to(dev)
        recs = [[_lookup(g, index, prefix) for g in gs] for gs in per_block]
        plans = _block_plans(index, per_block, recs, dtype, packed_dir, handle,  # type: ignore[arg-type]
                             setting, shapes)
    streamed = []
    for (_, module), groups, plan, shape in zip(named, per_block, plans, shapes):
        params = [_replace(g, placeholder(g.param.shape, dtype, dev)) for g in groups]
        plain, quant = split_bindings([(g.name, p) for g, p in zip(groups, params)], plan.tensor_offsets,
                                      shape, setting)
        streamed.append(StreamedBlock(module, plan, plain, quant))
    return install(model, streamed, device=dev, prefetch=prefetch, pin_memory=pin_memory, config=config)


def _block_plans(index: dict[str, CheckpointTensor], per_block: list[list[ParamGroup]],
                 recs: list[list[CheckpointTensor]], dtype: torch.dtype, packed_dir: str | Volume | None,
                 handle: AioHandle, setting: QuantSetting | None,
                 shapes: list[dict[str, tuple[int, int, bool]]]) -> list[BlockPlan]:
    for groups, rs in zip(per_block, recs):
        for g, r in zip(groups, rs):
            if r.shape != tuple(g.param.shape):
                raise DeepNVMeError(f"{r.file}: {r.name} has shape {r.shape}, the model expects "
                                    f"{tuple(g.param.shape)} for {g.name}")
    if packed_dir is None:
        bad = [r.name for rs in recs for r in rs if r.dtype != dtype]
        if bad:
            raise DeepNVMeError(f"checkpoint tensors such as {bad[0]!r} are {recs[0][0].dtype}, not "
                                f"{dtype}: pass packed_dir= to stream a converted aligned copy")
        sizes = {f: os.path.getsize(f) for f in {r.file for rs in recs for r in rs}}
        return [plan_block_reads([TensorRecord(g.name, r.file, r.offset, r.nbytes)
                                  for g, r in zip(groups, rs)], sizes)
                for groups, rs in zip(per_block, recs)]
    fingerprint = _fingerprint(index, dtype, [[g.name for g in gs] for gs in per_block])
    plans = load_manifest(packed_dir, fingerprint, _record(setting, dtype))
    if plans is not None:
        log.info("deepnvme: reusing the aligned copy in %s", packed_dir)
        return plans
    itemsize = torch.empty((), dtype=dtype).element_size()
    return write_packed(packed_dir, [
        [e for g, r in zip(groups, rs)
         for e in packed_entries(g.name, r.nbytes // r.dtype.itemsize * itemsize,
                                 functools.partial(_read_as, handle, r, dtype), shape.get(g.name), setting, dtype)]
        for groups, rs, shape in zip(per_block, recs, shapes)],
        handle=handle, fingerprint=fingerprint, setting=_record(setting, dtype))


__getattr__ = module_aliases(__name__, {"load_offloaded": "load_streamed"})
