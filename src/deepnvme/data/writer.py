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
from concurrent.futures import Future
from typing import Any

import torch

from ..formats.megatron_index import DTYPES, TokenDType, dtype_by_name, encode_index
from ..handles.aio import AioHandle
from ..io import durable
from ..io.volume import VolumePath
from ..io.volume_files import remove, rename, temp_path
from ..memory.views import aligned_empty, byte_view

__all__ = ["write_token_dataset"]

#: bytes per write of a striped .bin (two such buffers: one filling while one is written)
STRIPED_BLOCK = 16 << 20
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


def write_token_dataset(prefix: str | os.PathLike[str] | VolumePath, documents: Iterable[Any], *,
                        dtype: Any = "uint16") -> None:
    """Write ``documents`` as ``prefix.bin`` and ``prefix.idx``; blocks until both are durable.

    Args:
        prefix: the two files' path without suffix; missing folders on it are created. On a
            volume (``vol / "corpus"``) both files are striped over its drives, so
            :class:`~deepnvme.data.TokenDataset` reads samples from every drive at once.
        documents: token sequences (lists of ints, NumPy arrays, tensors), one per document.
        dtype: the tokens' type in the file: a NumPy name or dtype or a torch dtype (default
            uint16, for vocabularies below 65,536); a token that does not fit is a ValueError.

    Streams: memory holds one document plus 8 bytes per document; the .idx is built at the
    end. A failure leaves no partial file and any previous pair untouched.
    """
    kind = token_dtype(dtype)
    if isinstance(prefix, VolumePath):
        _write_striped(prefix, documents, kind)
        return
    prefix = os.fspath(prefix)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    lengths = array.array("q")
    with durable.atomic_target(f"{prefix}.bin") as tmp:
        with open(tmp, "wb") as f:
            for tokens in _checked_tokens(documents, kind, lengths):
                f.write(byte_view(tokens))
    count = len(lengths)
    sizes = torch.frombuffer(lengths, dtype=torch.int64) if count else torch.empty(0, dtype=torch.int64)
    pieces = encode_index(kind, sizes, torch.arange(count + 1, dtype=torch.int64))
    with durable.atomic_target(f"{prefix}.idx") as tmp:
        with open(tmp, "wb") as f:
            for piece in pieces:
                f.write(piece)


def _checked_tokens(documents: Iterable[Any], kind: TokenDType, lengths: array.array[int]) -> Iterable[torch.Tensor]:
    """Each document's tokens as ``kind``, its length appended to ``lengths``."""
    for j, doc in enumerate(documents):
        tokens = _as_tokens(doc, kind, j)
        if tokens.numel() > _MAX_LENGTH:
            raise ValueError(f"document {j} has {tokens.numel()} tokens, more than the format's "
                             f"int32 length field holds ({_MAX_LENGTH}); split it")
        lengths.append(tokens.numel())
        yield tokens


class _StripedSink:
    """Appends bytes to a striped file in blocks of :data:`STRIPED_BLOCK`, one block written
    (and fsynced on every part it touches) while the next fills. Memory: two blocks."""

    def __init__(self, handle: AioHandle, vpath: VolumePath) -> None:
        self.handle, self.vpath = handle, vpath
        self.blocks = [aligned_empty(STRIPED_BLOCK, min_bytes=0) for _ in range(2)]
        self.pending: list[Future[int] | None] = [None, None]
        self.current, self.filled, self.offset = 0, 0, 0

    def write(self, data: torch.Tensor) -> None:
        pos = 0
        while pos < data.numel():
            n = min(STRIPED_BLOCK - self.filled, data.numel() - pos)
            self.blocks[self.current][self.filled:self.filled + n].copy_(data[pos:pos + n])
            self.filled += n
            pos += n
            if self.filled == STRIPED_BLOCK:
                self._flush()

    def _flush(self) -> None:
        block = self.blocks[self.current][:self.filled]
        self.pending[self.current] = self.handle.submit_write(block, self.vpath, offset=self.offset, fsync=True)
        self.offset += self.filled
        self.current, self.filled = 1 - self.current, 0
        waiting = self.pending[self.current]  # the other block, written earlier, is reused next
        if waiting is not None:
            waiting.result()

    def close(self) -> int:
        """Write what is left and wait for every write; the file's size."""
        if self.filled or not self.offset:  # the tail, or an empty file (created and fsynced)
            self._flush()
        for f in self.pending:
            if f is not None:
                f.result()
        return self.offset


def _write_striped(prefix: VolumePath, documents: Iterable[Any], kind: TokenDType) -> None:
    """:func:`write_token_dataset` onto a volume: both files written under temporary names,
    then renamed into place (.bin before .idx); a failure removes them and leaves the
    previous pair untouched."""
    names = {suffix: VolumePath(prefix.volume, f"{prefix.name}.{suffix}") for suffix in ("bin", "idx")}
    temps = {suffix: temp_path(name) for suffix, name in names.items()}
    lengths = array.array("q")
    try:
        with AioHandle() as handle:
            sink = _StripedSink(handle, temps["bin"])
            for tokens in _checked_tokens(documents, kind, lengths):
                sink.write(tokens.reshape(-1).view(torch.uint8))
            sink.close()
            count = len(lengths)
            sizes = torch.frombuffer(lengths, dtype=torch.int64) if count else torch.empty(0, dtype=torch.int64)
            index = _StripedSink(handle, temps["idx"])
            for piece in encode_index(kind, sizes, torch.arange(count + 1, dtype=torch.int64)):
                if piece:
                    index.write(torch.frombuffer(bytearray(piece), dtype=torch.uint8))
            index.close()
        rename(temps["bin"], names["bin"])
        rename(temps["idx"], names["idx"])
    except BaseException:
        for t in temps.values():
            remove(t)
        raise
