"""``TokenDataset``: fixed-length training samples from a Megatron indexed dataset (.bin + .idx).

Samples are windows of ``seq_len + 1`` tokens over the concatenation of every document in
file order, ``seq_len`` apart (consecutive samples share one token, as Megatron's GPT dataset
does for one unshuffled epoch); the last incomplete window is dropped. Reads go through an
:class:`~deepnvme.AioHandle` (aligned O_DIRECT reads, many in flight), not ``mmap``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.data

from ..config import IOConfig
from ..errors import DeepNVMeIOError
from ..formats.megatron_index import TokenIndex, parse_index
from ..handles.aio import AioHandle
from ..io.file import read_buffered
from ..io.plan import PAGE_SIZE
from ..memory.views import aligned_empty, byte_view
from ._plan import BatchPlan, SampleGeometry, batch_buffer_bytes, plan_batch
from ._prefetch import iterate_batches

__all__ = ["TokenDataset"]


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    """Samples of ``seq_len + 1`` tokens from ``prefix.bin`` / ``prefix.idx`` (Megatron's format).

    ``len(ds) == (total_tokens - 1) // seq_len``; ``ds[i]`` is tokens ``[i x seq_len, i x seq_len
    + seq_len + 1)`` of the concatenation as a 1-D int64 tensor (the file's dtype with
    ``keep_dtype=True``); :meth:`document` returns one document; :meth:`batches` reads many
    samples ahead. ``config`` sets the I/O handle (None: deepnvme's defaults and environment).

    Works with ``torch.utils.data.DataLoader`` worker processes: each process opens its own
    handle on first use (a changed pid is detected) and pickling drops the handle. The index
    arrays stay in memory: ``20 x sequences + 8 x documents`` bytes. Reads of one dataset
    from several threads are safe (the handle is thread-safe).
    """

    def __init__(self, prefix: str | os.PathLike[str], *, seq_len: int, keep_dtype: bool = False,
                 config: IOConfig | None = None) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        prefix = os.fspath(prefix)
        self.idx_path, self.bin_path = f"{prefix}.idx", f"{prefix}.bin"
        self.seq_len = seq_len
        self.keep_dtype = keep_dtype
        self._config = config
        self._handle: AioHandle | None = None
        self._pid = -1
        self.bin_size = os.stat(self.bin_path).st_size
        idx = torch.empty(os.stat(self.idx_path).st_size, dtype=torch.uint8)
        read_buffered(self.idx_path, idx, 0)
        self.index: TokenIndex = parse_index(byte_view(idx),
                                             path=self.idx_path, bin_path=self.bin_path,
                                             bin_size=self.bin_size)
        count = max((self.index.total_tokens - 1) // seq_len, 0)
        self.geometry = SampleGeometry(base=self.index.base, itemsize=self.index.dtype.itemsize,
                                       stride=seq_len, tokens=seq_len + 1, count=count,
                                       file_size=self.bin_size)

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
        return max(self._io_config().alignment, PAGE_SIZE)

    def _io_config(self) -> IOConfig:
        return self._io().config

    def _io(self) -> AioHandle:
        """This process's handle: made on first use and again in a forked child (DataLoader
        workers), whose copy of the parent's handle has no worker threads."""
        pid = os.getpid()
        if self._handle is None or self._pid != pid:
            self._handle = AioHandle(config=self._config)
            self._pid = pid
        return self._handle

    def plan(self, samples: Iterable[int], *, gap: int | None = None) -> BatchPlan:
        """The reads that fetch ``samples`` (see :mod:`deepnvme.data._plan`); ``gap`` None: one
        alignment unit (a hole that small is cheaper to read than a second request)."""
        cfg = self._io_config()
        align = max(cfg.alignment, PAGE_SIZE)
        return plan_batch(list(samples), self.geometry, alignment=align, max_read=cfg.block_size,
                          gap=align if gap is None else gap)

    def buffer_bytes(self, batch_size: int) -> int:
        """Bytes of the read buffer one batch of ``batch_size`` samples needs at most."""
        align = self.alignment
        return batch_buffer_bytes(batch_size, self.geometry, alignment=align, gap=align)

    def read_plan(self, plan: BatchPlan, buffer: torch.Tensor) -> None:
        """Execute ``plan`` into ``buffer`` (uint8, at least ``plan.buffer_bytes``); blocks."""
        got = self.submit_plan(plan, buffer).result()
        self.check_count(plan, got)

    def submit_plan(self, plan: BatchPlan, buffer: torch.Tensor) -> Any:
        """Start ``plan``'s reads into ``buffer``; a future of the byte count."""
        items = [(buffer[at:at + n], off) for at, off, n in plan.reads]
        return self._io().read_many(self.bin_path, items)

    def check_count(self, plan: BatchPlan, got: int) -> None:
        want = sum(n for _, _, n in plan.reads)
        if got != want:
            raise DeepNVMeIOError(f"read {got} of the {want} bytes planned", path=self.bin_path,
                                  offset=plan.reads[0][1] if plan.reads else 0, size=want)

    def _out_dtype(self) -> torch.dtype:
        return self.dtype if self.keep_dtype else torch.int64

    def __getitem__(self, i: int) -> torch.Tensor:
        plan = self.plan([i])
        buffer = aligned_empty(plan.buffer_bytes, alignment=self.alignment, min_bytes=0)
        self.read_plan(plan, buffer)
        at = plan.sample_at[0]
        tokens = buffer[at:at + self.geometry.sample_bytes].view(self.dtype)
        return tokens.to(self._out_dtype(), copy=True)

    def document(self, j: int) -> torch.Tensor:
        """Document ``j``'s tokens (all its sequences), 1-D, int64 or the file's dtype."""
        start, nbytes = self.index.document_bytes(j)
        align = self.alignment
        lo = start - start % align
        hi = min(-(-(start + nbytes) // align) * align, self.bin_size)
        plan = BatchPlan(reads=((0, lo, hi - lo),), sample_at=(start - lo,), buffer_bytes=hi - lo)
        buffer = aligned_empty(hi - lo, alignment=align, min_bytes=0)
        if nbytes:
            self.read_plan(plan, buffer)
        return buffer[start - lo:start - lo + nbytes].view(self.dtype).to(self._out_dtype(), copy=True)

    def batches(self, order: Iterable[int] | torch.Tensor, batch_size: int, *, prefetch: int = 8,
                pin_memory: bool = False, drop_last: bool = False,
                device: str | torch.device | None = None) -> Iterator[torch.Tensor]:
        """Yield ``[batch, seq_len + 1]`` tensors of the samples of ``order`` in that order.

        Reads run up to ``prefetch`` batches ahead of the consumer (in groups of
        ``max(1, prefetch // 4)`` batches per ``read_many`` call), samples widened to the
        O_DIRECT alignment and coalesced with their neighbours; no worker processes. Memory:
        ``prefetch x batch_size x (align_up(sample_bytes, A) + 2 A)`` bytes of pooled
        page-locked read buffers (A = :attr:`alignment`, sample_bytes = ``(seq_len + 1) x
        itemsize``; ``prefetch`` rounded down to a multiple of the group), freed when the
        iterator ends, plus the yielded batches, which the caller owns (``pin_memory``:
        allocated page-locked). The last short batch is dropped with
        ``drop_last``. Out-of-range indices raise IndexError before their batch is read.
        ``device`` (e.g. ``"cuda"``): batches are yielded there, each copied through one reused
        page-locked staging batch, the copy done when the batch is yielded.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be a positive int, got {prefetch!r}")
        target = _batch_device(device)
        if isinstance(order, torch.Tensor):
            order = order.tolist()
        return iterate_batches(self, order, batch_size, prefetch=prefetch, pin_memory=pin_memory,
                               drop_last=drop_last, device=target)

    def gather(self, at: Sequence[int], buffer: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the samples starting at bytes ``at`` of the read ``buffer`` (whose length is a
        multiple of 8) into the rows of ``out``: one strided copy when they lie evenly spaced
        (sequential order), else one ``index_select``."""
        tokens, itemsize = self.geometry.tokens, self.geometry.itemsize
        elements = buffer.view(self.dtype)
        step = at[1] - at[0] if len(at) > 1 else 0
        if step >= 0 and step % itemsize == 0 and all(at[k] == at[0] + k * step for k in range(len(at))):
            out.copy_(elements.as_strided((len(at), tokens), (step // itemsize, 1),
                                        elements.storage_offset() + at[0] // itemsize))
            return
        # one index_select over a view of every window of `tokens` elements (faster than a copy
        # per row, measured); as same-size integers, since not every dtype has the kernel (uint16)
        raw = elements.view(_SAME_SIZE_INT[itemsize])
        windows = raw.as_strided((raw.numel() - tokens + 1, tokens), (1, 1), raw.storage_offset())
        first = torch.tensor(at, dtype=torch.int64).floor_divide_(itemsize)
        out.copy_(torch.index_select(windows, 0, first).view(self.dtype))

    # --- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop this process's I/O threads (a later read starts new ones). Idempotent."""
        if self._handle is not None and self._pid == os.getpid():
            self._handle.close()
        self._handle = None

    def __enter__(self) -> TokenDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handle"], state["_pid"] = None, -1
        return state

    def __repr__(self) -> str:
        return (f"TokenDataset({self.bin_path[:-4]!r}, seq_len={self.seq_len}, samples={len(self)}, "
                f"documents={self.num_documents}, tokens={self.total_tokens}, "
                f"dtype={self.index.dtype.name})")
