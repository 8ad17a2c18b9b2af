"""The runtime of weight streaming: hooks that read each block's weights just in time.

Per block, a forward pre-hook (1) makes sure the block's read is in flight, (2) starts the reads
of the next ``prefetch`` blocks (cyclically: after the last block comes block 0 of the next
forward, e.g. the next decoding step) into free staging buffers, (3) waits for its own read and
(4) points the block's parameters at views of the staging buffer (``param.data = view``, no
copy on CPU; one host-to-device copy on CUDA); parameters stored quantised are dequantised
into one arena of the compute dtype on the device (the bound block's weights; only one block
is bound at a time). The forward hook points them back at 1-element
placeholders and frees the buffer. Reads prefetched for blocks that then do not run next are
waited for and dropped (``discarded_prefetches``). At most ``prefetch + 1`` staging buffers exist, so memory is
``(prefetch + 1) x largest block`` (x2 on CUDA: pinned host plus device buffers), plus the
dequantised bytes of the largest block's quantised weights.
Hooks run on the thread calling the model; the streamer is not meant for concurrent forwards.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future

import torch
from torch import nn

from ..config import IOConfig
from ..handles.aio import AioHandle
from ..memory.pinned import BufferPool
from ._blocks import placeholder
from ._layout import TENSOR_ALIGN, BlockPlan, align_up
from ._quant import QuantBinding, dequantize_into

__all__ = ["StreamStats", "StreamedBlock", "WeightStreamer"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StreamStats:
    """Counters since the streamer was built (or :meth:`WeightStreamer.reset_stats`).

    ``stall_seconds`` is time the model thread spent blocked waiting for weights; compute
    overlapped with I/O is ``wall - stall``. ``bytes_read`` counts completed reads (1 GB = 1e9 B);
    ``discarded_prefetches`` counts reads dropped because blocks ran in an unexpected order;
    ``dequant_seconds`` is host time spent dequantising quantised weights (on CUDA: launching).
    """

    blocks_loaded: int
    bytes_read: int
    stall_seconds: float
    discarded_prefetches: int
    dequant_seconds: float = 0.0


@dataclasses.dataclass
class StreamedBlock:
    """A block to stream: its module, where its bytes are, and which parameter sits where."""

    module: nn.Module
    plan: BlockPlan
    bindings: list[tuple[nn.Parameter, int]]  # (parameter, byte offset in the staging buffer)
    quantized: list[QuantBinding] = dataclasses.field(default_factory=list)  # dequantised when bound

    def params(self) -> list[nn.Parameter]:
        """Every streamed parameter of the block, plain and quantised."""
        return [p for p, _ in self.bindings] + [q.param for q in self.quantized]


class _Slot:
    __slots__ = ("host", "device", "futures", "copied", "compute_done", "index", "bound")

    def __init__(self, host: torch.Tensor, device: torch.Tensor | None) -> None:
        self.host = host
        self.device = device
        self.futures: list[Future[int]] = []
        self.copied: torch.cuda.Event | None = None        # H2D copy out of ``host`` finished
        self.compute_done: torch.cuda.Event | None = None  # last kernels using ``device`` finished
        self.index = -1
        self.bound = False


class WeightStreamer:
    """Installs the hooks on ``blocks`` and owns the staging buffers and the I/O handle."""

    def __init__(self, blocks: list[StreamedBlock], *, device: torch.device, prefetch: int,
                 pin_memory: bool, config: IOConfig | None) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if not blocks:
            raise ValueError("nothing to stream: the model has no streamed blocks")
        self.blocks = blocks
        self.device = device
        self.prefetch = min(prefetch, len(blocks) - 1)
        self._cuda = device.type == "cuda"
        self._handle = AioHandle(config=config)
        self.buffer_bytes = max(b.plan.buffer_bytes for b in blocks)
        count = self.prefetch + 1
        self._pool = BufferPool(self.buffer_bytes, count) if pin_memory else None
        self._free: list[_Slot] = []
        self._slots_made = 0
        self._count = count
        self._inflight: OrderedDict[int, _Slot] = OrderedDict()
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None
        self._placeholders = {id(p): placeholder(p.shape, p.dtype, device)
                              for b in blocks for p in b.params()}
        self._arena_at: dict[int, int] = {}   # id(param) -> byte offset of its dequantised copy
        self._arena_bytes = 0
        for b in blocks:
            cursor = 0
            for q in b.quantized:
                self._arena_at[id(q.param)] = cursor
                cursor = align_up(cursor + q.out_nbytes, TENSOR_ALIGN)
            self._arena_bytes = max(self._arena_bytes, cursor)
        self._arena: torch.Tensor | None = None
        self._hooks = []
        for i, b in enumerate(blocks):
            self._hooks.append(b.module.register_forward_pre_hook(self._make_pre(i)))
            self._hooks.append(b.module.register_forward_hook(self._make_post(i)))
        self.reset_stats()

    # --- stats -------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self._loaded = 0
        self._bytes = 0
        self._stall = 0.0
        self._discarded = 0
        self._dequant = 0.0

    def stats(self) -> StreamStats:
        return StreamStats(self._loaded, self._bytes, self._stall, self._discarded, self._dequant)

    # --- slots -------------------------------------------------------------------------------

    def _new_slot(self) -> _Slot:
        # Normal tensors even when the first forward runs under inference_mode, so the buffers
        # can be reused and freed outside it.
        with torch.inference_mode(False):
            if self._pool is not None:
                host = self._pool.acquire(timeout=0)
            else:
                host = torch.empty(self.buffer_bytes, dtype=torch.uint8)
            dev = (torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
                   if self._cuda else None)
        self._slots_made += 1
        return _Slot(host, dev)

    def _take_slot(self) -> _Slot | None:
        if self._free:
            return self._free.pop()
        if self._slots_made < self._count:
            return self._new_slot()
        return None

    def _drain(self, slot: _Slot) -> None:
        for fut in slot.futures:
            fut.exception()
        slot.futures = []

    def _submit(self, index: int) -> None:
        if index in self._inflight:
            return
        slot = self._take_slot()
        if slot is None:
            raise RuntimeError("deepnvme: no free staging buffer (streamed blocks must not call "
                               "each other)")
        if slot.copied is not None:
            slot.copied.synchronize()   # the host buffer is still being copied to the device
            slot.copied = None
        slot.index = index
        for span in self.blocks[index].plan.spans:
            view = slot.host[span.buffer_offset: span.buffer_offset + span.nbytes]
            slot.futures.append(self._handle.submit_read(view, span.file, offset=span.file_offset))
        self._inflight[index] = slot

    def _wait(self, index: int) -> _Slot:
        slot = self._inflight[index]
        if slot.futures:
            t0 = time.perf_counter()
            try:
                for fut in slot.futures:
                    self._bytes += fut.result()
            except BaseException:
                self._drain(slot)
                del self._inflight[index]
                self._free.append(slot)
                raise
            finally:
                self._stall += time.perf_counter() - t0
            slot.futures = []
            self._loaded += 1
            if self._cuda:
                self._to_device(slot)
        return slot

    def _to_device(self, slot: _Slot) -> None:
        stream, dev = self._copy_stream, slot.device
        if stream is None or dev is None:
            raise RuntimeError("deepnvme: device copy requested on a CPU streamer")
        with torch.cuda.stream(stream):
            if slot.compute_done is not None:
                stream.wait_event(slot.compute_done)
            dev.copy_(slot.host, non_blocking=True)
            slot.copied = torch.cuda.Event()
            slot.copied.record(stream)
        torch.cuda.current_stream(self.device).wait_event(slot.copied)

    # --- binding -----------------------------------------------------------------------------

    def _bind(self, index: int, slot: _Slot) -> None:
        base = slot.device if slot.device is not None else slot.host
        for param, offset in self.blocks[index].bindings:
            nbytes = param.numel() * param.element_size()
            param.data = base[offset: offset + nbytes].view(param.dtype).view(param.shape)
        if self.blocks[index].quantized:
            self._dequantize(index, base)
        slot.bound = True

    def _dequantize(self, index: int, base: torch.Tensor) -> None:
        t0 = time.perf_counter()
        if self._arena is None:
            with torch.inference_mode(False):
                self._arena = torch.empty(self._arena_bytes, dtype=torch.uint8, device=self.device)
        for q in self.blocks[index].quantized:
            at = self._arena_at[id(q.param)]
            dtype = q.param.dtype
            out = self._arena[at: at + q.out_nbytes].view(dtype).view(q.rows, q.cols)
            scale_bytes = q.scale_count * q.param.element_size()
            dequantize_into(out, base[q.data_offset: q.data_offset + q.code_nbytes],
                            base[q.scale_offset: q.scale_offset + scale_bytes].view(dtype),
                            mode=q.mode, group_size=q.group_size)
            q.param.data = out.t() if q.transposed else out
        self._dequant += time.perf_counter() - t0

    def _unbind(self, index: int) -> None:
        slot = self._inflight.pop(index, None)
        if slot is None:
            return
        for param in self.blocks[index].params():
            param.data = self._placeholders[id(param)]
        slot.bound = False
        if self._cuda:
            slot.compute_done = torch.cuda.Event()
            slot.compute_done.record(torch.cuda.current_stream(self.device))
        self._free.append(slot)

    def _make_pre(self, index: int):  # type: ignore[no-untyped-def]
        def pre_hook(module: nn.Module, args: object) -> None:
            n = len(self.blocks)
            wanted = [(index + k) % n for k in range(self.prefetch + 1)]
            for other, slot in list(self._inflight.items()):
                if slot.bound and other != index:   # left bound by a forward that raised
                    self._unbind(other)
                elif other not in wanted:          # prefetched for an order that did not happen
                    del self._inflight[other]
                    self._drain(slot)
                    self._free.append(slot)
                    self._discarded += 1
            for k in wanted:                       # own block first, then the ones ahead
                self._submit(k)
            self._bind(index, self._wait(index))
        return pre_hook

    def _make_post(self, index: int):  # type: ignore[no-untyped-def]
        def post_hook(module: nn.Module, args: object, output: object) -> None:
            self._unbind(index)
        return post_hook

    # --- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the hooks, finish outstanding reads and free the staging buffers. The
        streamed parameters keep their placeholders (the model can no longer run)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for index in list(self._inflight):
            slot = self._inflight.pop(index)
            self._drain(slot)
            self._free.append(slot)
        for slot in self._free:
            if self._pool is not None:
                self._pool.release(slot.host)
        self._free = []
        if self._pool is not None:
            self._pool.close()
        self._arena = None
        self._handle.close()
