"""``write_token_dataset``: write documents as a Megatron indexed dataset (.bin + .idx).

The files are what megatron-core's ``IndexedDatasetBuilder`` writes for one sequence per
document, so Megatron and :class:`~deepnvme.data.TokenDataset` read them; Megatron itself is
not needed. Each file appears atomically and durably (temporary name, fsync, rename, fsync of
the directory: :mod:`deepnvme.io.durable`), the .bin before the .idx. A missing folder of
``prefix`` is created first, as :class:`~deepnvme.CheckpointManager` creates its directory.
"""

from __future__ import annotations

import array
import os
from collections.abc import Iterable
from typing import Any

import torch

from ..formats.megatron_index import DTYPES, TokenDType, dtype_by_name, encode_index
from ..io import durable
from ..memory.views import byte_view

__all__ = ["write_token_dataset"]

_MAX_LENGTH = 2**31 - 1  # tokens per sequence: the .idx stores lengths as int32
_TORCH_NAMES = {d.torch_dtype: d.name for d in DTYPES.values()}


def token_dtype(dtype: Any) -> TokenDType:
    """The format's dtype for a NumPy name, NumPy dtype or scalar type, or torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_NAMES:
            raise ValueError(f"dtype {dtype} cannot be stored in a Megatron indexed dataset; choose "
                             f"one of {', '.join(str(t) for t in _TORCH_NAMES)}")
        return dtype_by_name(_TORCH_NAMES[dtype])
    if isinstance(dtype, str):
        return dtype_by_name(dtype)
    name = getattr(dtype, "name", None) if not isinstance(dtype, type) else getattr(dtype, "__name__", None)
    if isinstance(name, str):  # numpy.dtype('uint16').name, numpy.uint16.__name__
        return dtype_by_name(name)
    raise TypeError(f"dtype must be a name, a NumPy dtype or a torch dtype, got {dtype!r}")


def _as_tokens(doc: Any, dtype: TokenDType, j: int) -> torch.Tensor:
    """Document ``j`` as a 1-D contiguous CPU tensor of ``dtype``; ValueError for tokens that do
    not fit (a silent wrap-around would corrupt the corpus)."""
    if isinstance(doc, torch.Tensor):
        t = doc.detach().cpu().reshape(-1)
    elif hasattr(doc, "__array__"):
        t = torch.as_tensor(doc).reshape(-1)
    else:
        values = list(doc)
        floating = dtype.torch_dtype.is_floating_point
        t = torch.tensor(values, dtype=torch.float64 if floating else torch.int64)
    target = dtype.torch_dtype
    if not target.is_floating_point and t.numel():
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"document {j}: tokens of dtype {t.dtype} cannot be stored as {dtype.name}")
        if t.dtype != target:
            info = torch.iinfo(target)
            lo, hi = int(t.min()), int(t.max())
            if lo < info.min or hi > info.max:
                raise ValueError(f"document {j}: token {lo if lo < info.min else hi} does not fit "
                                 f"{dtype.name} ({info.min}..{info.max}); choose a wider dtype")
    return t.to(target).contiguous()


def write_token_dataset(prefix: str | os.PathLike[str], documents: Iterable[Any], *,
                        dtype: Any = "uint16") -> None:
    """Write ``documents`` as ``prefix.bin`` and ``prefix.idx``; blocks until both are durable.

    Args:
        prefix: the two files' path without suffix; missing folders on it are created.
        documents: token sequences (lists of ints, NumPy arrays, tensors), one per document.
        dtype: the tokens' type in the file: a NumPy name or dtype or a torch dtype (default
            uint16, for vocabularies below 65,536); a token that does not fit is a ValueError.

    Streams: memory holds one document plus 8 bytes per document; the .idx is built at the
    end. A failure leaves no partial file and any previous pair untouched.
    """
    kind = token_dtype(dtype)
    prefix = os.fspath(prefix)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    lengths = array.array("q")
    with durable.atomic_target(f"{prefix}.bin") as tmp:
        with open(tmp, "wb") as f:
            for j, doc in enumerate(documents):
                tokens = _as_tokens(doc, kind, j)
                if tokens.numel() > _MAX_LENGTH:
                    raise ValueError(f"document {j} has {tokens.numel()} tokens, more than the format's "
                                     f"int32 length field holds ({_MAX_LENGTH}); split it")
                f.write(byte_view(tokens))
                lengths.append(tokens.numel())
    count = len(lengths)
    sizes = torch.frombuffer(lengths, dtype=torch.int64) if count else torch.empty(0, dtype=torch.int64)
    pieces = encode_index(kind, sizes, torch.arange(count + 1, dtype=torch.int64))
    with durable.atomic_target(f"{prefix}.idx") as tmp:
        with open(tmp, "wb") as f:
            for piece in pieces:
                f.write(piece)
