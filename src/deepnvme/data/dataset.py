"""``TokenDataset``: fixed-length training samples from a Megatron indexed dataset (.bin + .idx).

Samples are windows of ``seq_len + 1`` tokens over the concatenation of every document in
file order, ``seq_len`` apart (consecutive samples share one token, as Megatron's GPT dataset
does for one unshuffled epoch); the last incomplete window is dropped. Reads go through the
sample reader (:mod:`deepnvme.data._reader`: an :class:`~deepnvme.AioHandle`, aligned O_DIRECT
reads, many in flight), not ``mmap``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.utils.data

from ..config import IOConfig
from ..errors import DeepNVMeIOError
from ..formats.megatron_index import TokenIndex, parse_index
from ..handles.aio import AioHandle
from ..io.file import read_buffered
from ..io.volume import VolumePath
from ..io.volume_files import striped_size
from ..memory.views import byte_view
from ._plan import SampleGeometry
from ._prefetch import iterate_batches
from ._reader import SampleReader

__all__ = ["TokenDataset"]


def _batch_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` checked up front: a name torch does not know, or CUDA where there is none, is
    a ValueError naming it (not an error at the first batch)."""
    if device is None:
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"batches(device={device!r}): not a torch device: {exc}") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"batches(device={device!r}): CUDA is not available here")
    return target


class TokenDataset(torch.utils.data.Dataset[torch.Tensor]):
    """Fixed-length samples of a Megatron indexed dataset (``prefix.bin`` + ``prefix.idx``).

    ``len(ds) == (total_tokens - 1) // seq_len``; ``ds[i]`` is tokens ``[i x seq_len, i x seq_len
    + seq_len + 1)`` of the concatenation of every document, as a fresh 1-D tensor;
    :meth:`document` returns one document; :meth:`batches` reads many samples ahead.

    Args:
        prefix: the two files' path without suffix (``"corpus"`` for ``corpus.bin`` and
            ``corpus.idx``), as :func:`~deepnvme.data.write_token_dataset` writes them; on a
            volume (``vol / "corpus"``) the two striped files, read from every drive at once.
        seq_len: tokens a sample advances by; each sample holds ``seq_len + 1`` tokens (the
            inputs and the labels shifted by one). A positive int.
        keep_dtype: hand out tokens in the file's dtype (e.g. uint16) instead of int64.
        config: the settings of the I/O handle that reads the .bin; None: the ``DEEPNVME_*``
            environment, then deepnvme's defaults.

    Raises:
        FileNotFoundError: a file is missing (the message names it).
        DatasetFormatError: the .idx is not Megatron's format or does not match the .bin.
        ValueError: ``seq_len`` is not a positive int.

    Works with ``torch.utils.data.DataLoader`` worker processes: each process opens its own
    handle on first use (a changed pid is detected) and pickling drops the handle. The index
    arrays stay in memory: ``20 x sequences + 8 x documents`` bytes. Reads of one dataset
    from several threads are safe (the handle is thread-safe). :meth:`close` (or leaving a
    ``with`` block) stops this process's I/O threads.
    """

    def __init__(self, prefix: str | os.PathLike[str] | VolumePath, *, seq_len: int, keep_dtype: bool = False,
                 config: IOConfig | None = None) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        self.seq_len = seq_len
        self.keep_dtype = keep_dtype
        self.idx_path: str | VolumePath
        self.bin_path: str | VolumePath
        if isinstance(prefix, VolumePath):  # both files striped over the volume's drives
            self.idx_path, self.bin_path = (VolumePath(prefix.volume, f"{prefix.name}.{s}") for s in ("idx", "bin"))
            self.bin_size = striped_size(self.bin_path)
            idx = torch.empty(striped_size(self.idx_path), dtype=torch.uint8)
            with AioHandle(config=config) as handle:
                got = handle.submit_read(idx, self.idx_path).result()
            if got != idx.numel():
                raise DeepNVMeIOError(f"read {got} of {idx.numel()} bytes", path=str(self.idx_path), offset=0,
                                      size=idx.numel())
        else:
            plain = os.fspath(prefix)
            self.idx_path, self.bin_path = f"{plain}.idx", f"{plain}.bin"
            self.bin_size = os.stat(self.bin_path).st_size
            idx = torch.empty(os.stat(self.idx_path).st_size, dtype=torch.uint8)
            read_buffered(self.idx_path, idx, 0)
        self.index: TokenIndex = parse_index(byte_view(idx),
                                             path=str(self.idx_path), bin_path=str(self.bin_path),
                                             bin_size=self.bin_size)
        count = max((self.index.total_tokens - 1) // seq_len, 0)
        self.geometry = SampleGeometry(base=self.index.base, itemsize=self.index.dtype.itemsize,
                                       stride=seq_len, tokens=seq_len + 1, count=count,
                                       file_size=self.bin_size)
        self._reader = SampleReader(self.bin_path, self.geometry, dtype=self.dtype,
                                    out_dtype=self.dtype if keep_dtype else torch.int64,
                                    config=config)

    # --- what the dataset holds --------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        """The tokens' dtype in the file."""
        return self.index.dtype.torch_dtype

    @property
    def total_tokens(self) -> int:
        return self.index.total_tokens

    @property
    def num_documents(self) -> int:
        return self.index.num_documents

    @property
    def num_sequences(self) -> int:
        """Sequences in the .idx (equal to the documents unless a document was split)."""
        return len(self.index.lengths)

    def __len__(self) -> int:
        return self.geometry.count

    # --- reads -------------------------------------------------------------------------------

    @property
    def alignment(self) -> int:
        """The O_DIRECT alignment reads are planned with (bytes)."""
        return self._reader.alignment

    def buffer_bytes(self, batch_size: int) -> int:
        """Bytes of the read buffer one batch of ``batch_size`` samples needs at most."""
        return self._reader.buffer_bytes(batch_size)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._reader.sample(i)

    def __getitems__(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """The samples of ``indices`` (rows of one fresh ``[len, seq_len + 1]`` tensor), read with
        one plan and one read call for all of them: what a ``DataLoader`` with a ``batch_size``
        or ``batch_sampler`` calls in each worker instead of ``__getitem__`` per sample."""
        return list(self._reader.samples(indices).unbind(0))

    def document(self, j: int) -> torch.Tensor:
        """Document ``j``'s tokens (all its sequences), 1-D, int64 or the file's dtype."""
        return self._reader.span(*self.index.document_bytes(j))

    def batches(self, order: Iterable[int] | torch.Tensor, batch_size: int, *, prefetch: int = 8,
                pin_memory: bool = False, drop_last: bool = False,
                device: str | torch.device | None = None) -> Iterator[torch.Tensor]:
        """Yield ``[batch, seq_len + 1]`` tensors of the samples of ``order`` in that order.

        Args:
            order: sample indices (any order, repeats allowed, negative ones from the end), an
                iterable or a 1-D tensor.
            batch_size: samples per batch; a positive int.
            prefetch: batches read ahead of the consumer (read in groups of
                ``max(1, prefetch // 2)`` batches per ``read_many`` call).
            pin_memory: allocate the yielded batches page-locked.
            drop_last: drop the last batch when it is short.
            device: yield batches there (e.g. ``"cuda"``), each copied through one reused
                page-locked staging batch, the copy done when the batch is yielded; None: CPU.

        Raises:
            ValueError: a bad ``batch_size``, ``prefetch`` or ``device`` (at the call).
            IndexError: an index out of range (before its batch is read).

        Samples are widened to the O_DIRECT alignment and coalesced with their neighbours; no
        worker processes. Memory: ``prefetch x batch_size x (align_up(sample_bytes, A) + 2 A)``
        bytes of pooled page-locked read buffers (A = :attr:`alignment`, sample_bytes =
        ``(seq_len + 1) x itemsize``; ``prefetch`` rounded down to a multiple of the group),
        kept when the iterator ends for the next call with the same sizes until :meth:`close`,
        plus the yielded batches, which the caller owns.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be a positive int, got {prefetch!r}")
        target = _batch_device(device)
        return iterate_batches(self._reader, order, batch_size, prefetch=prefetch, pin_memory=pin_memory,
                               drop_last=drop_last, device=target)

    # --- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop this process's I/O threads (a later read starts new ones). Idempotent."""
        self._reader.close()

    def __enter__(self) -> TokenDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = (VolumePath(self.bin_path.volume, self.bin_path.name[:-4]) if isinstance(self.bin_path, VolumePath)
                 else self.bin_path[:-4])
        return (f"TokenDataset({where!r}, seq_len={self.seq_len}, samples={len(self)}, "
                f"documents={self.num_documents}, tokens={self.total_tokens}, "
                f"dtype={self.index.dtype.name})")
