"""Group-quantised block weights for streaming: int8 or int4 codes plus one scale per group.

Symmetric per-group quantisation along the input dimension of a linear layer's weight: the
weight is seen as a ``(rows, cols)`` matrix whose ``cols`` are the inputs (``nn.Linear``'s
``(out, in)``; transformers' ``Conv1D`` stores ``(in, out)`` and is transposed first), each row
is cut into groups of ``group_size`` inputs, and each group stores ``scale = max|w| / qmax``
(``qmax`` 127 for int8, 7 for int4) and ``q = round(w / scale)``. Scales are stored in the
compute dtype, so dequantising is two vectorised passes in that dtype (a copy of the codes and
one multiply by the scales).

Byte layout of one tensor (pure functions below, unit-tested without a disk):

* int8: ``rows x cols`` signed bytes, row-major.
* int4: per group of ``g`` codes, ``ceil(g / 2)`` bytes; byte ``j`` holds code ``j`` in its low
  nibble and code ``j + ceil(g / 2)`` in its high nibble (two's complement, a zero nibble pads
  an odd group), so each half of a group unpacks as one contiguous run.
* scales: ``rows x cols / group_size`` values of the compute dtype, stored as a separate tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["QUANT_MODES", "QuantSetting", "QuantBinding", "resolve_setting", "quantize", "pack_int4",
           "unpack_int4", "dequantize", "dequantize_into", "code_nbytes", "scale_nbytes",
           "matrix_shape", "encode", "SCALE_SUFFIX", "plan_quantized", "packed_entries",
           "split_bindings"]

QUANT_MODES = {"int8": 127, "int4": 7}   # mode -> largest code magnitude
DEFAULT_GROUP_SIZE = 128
SCALE_SUFFIX = ":scale"   # key of a quantised tensor's scales in a packed block (":" is in no parameter name)


@dataclasses.dataclass(frozen=True)
class QuantSetting:
    """How block weights are stored: ``mode`` ("int8" or "int4") and ``group_size`` inputs per scale."""

    mode: str
    group_size: int

    @property
    def qmax(self) -> int:
        return QUANT_MODES[self.mode]

    def record(self, dtype: torch.dtype) -> dict[str, Any]:
        """The setting as a packed folder's manifest records it (compute dtype included)."""
        return {"quantize": self.mode, "group_size": self.group_size, "dtype": str(dtype).replace("torch.", "")}


def resolve_setting(quantize: str | None, group_size: int | None) -> QuantSetting | None:
    """Check the public ``quantize=`` / ``group_size=`` pair; None means unquantised weights."""
    if quantize is None:
        if group_size is not None:
            raise ValueError(f"group_size={group_size} applies only with quantize='int8' or 'int4'")
        return None
    if quantize not in QUANT_MODES:
        raise ValueError(f"quantize must be one of {sorted(QUANT_MODES)} or None, got {quantize!r}")
    size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    return QuantSetting(quantize, size)


def matrix_shape(module: nn.Module, attr: str, param: torch.Tensor) -> tuple[int, int, bool] | None:
    """``(rows, cols, transposed)`` when ``module.attr`` is a linear layer's 2-D weight (cols =
    inputs), else None: such a weight is quantised, anything else (norms, biases) is not."""
    if attr != "weight" or param.dim() != 2:
        return None
    if isinstance(module, nn.Linear):
        return int(param.shape[0]), int(param.shape[1]), False
    if type(module).__name__ == "Conv1D":   # transformers' GPT-2 layer: weight is (in, out)
        return int(param.shape[1]), int(param.shape[0]), True
    if any(c.__name__ == "LinearBase" for c in type(module).__mro__):   # vLLM's linear layers (fused
        return int(param.shape[0]), int(param.shape[1]), False          # qkv_proj too): (out, in) per rank
    return None


def check_group(name: str, shape: tuple[int, ...], cols: int, setting: QuantSetting) -> None:
    if cols % setting.group_size:
        raise ValueError(f"group_size {setting.group_size} does not divide the input dimension {cols} of "
                         f"{name} (shape {tuple(shape)}); choose a group_size that divides {cols}")


def code_nbytes(mode: str, rows: int, cols: int, group_size: int) -> int:
    """Bytes of the codes of a ``rows x cols`` matrix."""
    if mode == "int8":
        return rows * cols
    return rows * (cols // group_size) * ((group_size + 1) // 2)


def scale_nbytes(rows: int, cols: int, group_size: int, dtype: torch.dtype) -> int:
    return rows * (cols // group_size) * torch.empty((), dtype=dtype).element_size()


def quantize(weight: torch.Tensor, setting: QuantSetting, scale_dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``(rows, cols)`` int8 in ``[-qmax, qmax]`` and scales ``(rows * cols / group_size,)``
    of ``scale_dtype`` for a ``(rows, cols)`` weight; computed in float32 with the scale rounded
    to ``scale_dtype`` first, so ``codes * scales`` is what the reader reconstructs."""
    rows, cols = weight.shape
    if cols % setting.group_size:
        raise ValueError(f"group_size {setting.group_size} does not divide {cols} columns")
    w = weight.detach().to(torch.float32).reshape(-1, setting.group_size)
    scale = (w.abs().amax(dim=1) / setting.qmax).to(scale_dtype)
    s = scale.to(torch.float32)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round(w / safe[:, None]).clamp_(-setting.qmax, setting.qmax)
    return codes.to(torch.int8).reshape(rows, cols), scale


def pack_int4(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """Pack int8 codes in ``[-8, 7]`` (any shape, numel a multiple of ``group_size``) two per
    byte, group by group: ``numel / group_size x ceil(group_size / 2)`` bytes, 1-D uint8."""
    g = codes.reshape(-1, group_size).to(torch.int16)
    half = (group_size + 1) // 2
    lo = g[:, :half] & 0xF
    hi = torch.zeros_like(lo)
    hi[:, : group_size - half] = g[:, half:] & 0xF
    return (lo | (hi << 4)).to(torch.uint8).reshape(-1)


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``(groups, group_size)`` int8 codes."""
    half = (group_size + 1) // 2
    p = packed.reshape(-1, half)
    lo = (p << 4).view(torch.int8) >> 4     # arithmetic shift sign-extends the nibble
    hi = p.view(torch.int8) >> 4
    return torch.cat((lo, hi[:, : group_size - half]), dim=1)


def encode(weight: torch.Tensor, setting: QuantSetting, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored bytes of a ``(rows, cols)`` weight: (codes as 1-D uint8, scales of ``dtype``)."""
    codes, scales = quantize(weight, setting, dtype)
    if setting.mode == "int4":
        return pack_int4(codes, setting.group_size), scales
    return codes.reshape(-1).view(torch.uint8), scales


def dequantize_into(out: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, *, mode: str,
                    group_size: int) -> torch.Tensor:
    """Write the weight encoded as ``data`` (uint8 bytes, :func:`encode`'s layout) and ``scales``
    into the contiguous ``out`` (the compute dtype, any shape of the right numel); returns ``out``.
    Vectorised: one copy of the codes into ``out`` and one in-place multiply by the scales."""
    groups = out.numel() // group_size
    o = out.view(groups, group_size)
    if mode == "int8":
        o.copy_(data.view(torch.int8).view(groups, group_size))
    elif mode == "int4":
        half = (group_size + 1) // 2
        p = data.view(groups, half)
        o[:, :half].copy_((p << 4).view(torch.int8) >> 4)
        o[:, half:].copy_((p.view(torch.int8) >> 4)[:, : group_size - half])
    else:
        raise ValueError(f"unknown quantisation mode {mode!r}")
    return o.mul_(scales.view(groups, 1)).view(out.shape)


def dequantize(data: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], *, mode: str,
               group_size: int) -> torch.Tensor:
    """:func:`dequantize_into` a new ``shape`` tensor of the scales' dtype."""
    out = torch.empty(shape, dtype=scales.dtype, device=scales.device)
    return dequantize_into(out, data, scales, mode=mode, group_size=group_size)


@dataclasses.dataclass(frozen=True)
class QuantBinding:
    """A streamed parameter stored quantised: its codes and scales at byte offsets of the staging
    buffer; bound as a ``(rows, cols)`` dequantised matrix (its transpose when ``transposed``)."""

    param: nn.Parameter
    data_offset: int
    scale_offset: int
    rows: int
    cols: int
    transposed: bool
    mode: str
    group_size: int

    @property
    def out_nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()

    @property
    def code_nbytes(self) -> int:
        return code_nbytes(self.mode, self.rows, self.cols, self.group_size)

    @property
    def scale_count(self) -> int:
        return self.rows * self.cols // self.group_size


def plan_quantized(groups: Sequence[tuple[str, torch.Tensor, Sequence[tuple[nn.Module, str]]]],
                   setting: QuantSetting | None) -> dict[str, tuple[int, int, bool]]:
    """Which of a block's parameters ``(name, param, owners)`` are stored quantised, as
    ``name -> (rows, cols, transposed)``; raises naming the tensor when ``group_size`` does not
    divide its input dimension. A weight shared by modules of different kinds stays unquantised."""
    if setting is None:
        return {}
    out: dict[str, tuple[int, int, bool]] = {}
    for name, param, owners in groups:
        shapes = {matrix_shape(mod, attr, param) for mod, attr in owners}
        shape = shapes.pop() if len(shapes) == 1 else None
        if shape is not None:
            check_group(name, tuple(param.shape), shape[1], setting)
            out[name] = shape
    return out


class _Encoder:
    """Quantises one weight once for the two packed entries (codes, then scales) it becomes."""

    def __init__(self, produce: Callable[[], torch.Tensor], transposed: bool, setting: QuantSetting,
                 dtype: torch.dtype) -> None:
        self._produce, self._transposed, self._setting, self._dtype = produce, transposed, setting, dtype
        self._scales: torch.Tensor | None = None

    def _encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self._produce()
        return encode(w.t() if self._transposed else w, self._setting, self._dtype)

    def codes(self) -> torch.Tensor:
        data, self._scales = self._encode()
        return data

    def scales(self) -> torch.Tensor:
        scales = self._scales
        if scales is None:
            _, scales = self._encode()
        self._scales = None
        return scales


def packed_entries(name: str, nbytes: int, produce: Callable[[], torch.Tensor],
                   shape: tuple[int, int, bool] | None, setting: QuantSetting | None,
                   dtype: torch.dtype) -> list[tuple[str, int, Callable[[], torch.Tensor]]]:
    """The packed-block entries ``(key, nbytes, producer)`` of one parameter whose bytes in
    ``dtype`` ``produce`` returns: itself, or its codes and scales when ``shape`` is given."""
    if shape is None or setting is None:
        return [(name, nbytes, produce)]
    rows, cols, transposed = shape
    enc = _Encoder(produce, transposed, setting, dtype)
    return [(name, code_nbytes(setting.mode, rows, cols, setting.group_size), enc.codes),
            (name + SCALE_SUFFIX, scale_nbytes(rows, cols, setting.group_size, dtype), enc.scales)]


def split_bindings(params: Sequence[tuple[str, nn.Parameter]], offsets: dict[str, int],
                   shapes: dict[str, tuple[int, int, bool]], setting: QuantSetting | None
                   ) -> tuple[list[tuple[nn.Parameter, int]], list[QuantBinding]]:
    """A block's plain ``(param, offset)`` bindings and its quantised ones, from the packed
    block's tensor ``offsets``."""
    plain: list[tuple[nn.Parameter, int]] = []
    quant: list[QuantBinding] = []
    for name, param in params:
        shape = shapes.get(name)
        if shape is None or setting is None:
            plain.append((param, offsets[name]))
            continue
        if name + SCALE_SUFFIX not in offsets:
            raise ValueError(f"the packed block holds no scales for {name} ({setting.mode})")
        quant.append(QuantBinding(param, offsets[name], offsets[name + SCALE_SUFFIX], shape[0], shape[1],
                                  shape[2], setting.mode, setting.group_size))
    return plain, quant
