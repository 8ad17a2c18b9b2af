"""The compute device of an offload that trains on a GPU: buffers, side-stream copies, events.

A model trained on a device keeps its master parameters in the offload's files and host buffers;
the device path copies each parameter host->device before use and each gradient device->host
after the backward produced it. :class:`ComputeDevice` is all it needs from the device, so the
same path runs with CUDA (:class:`CudaDevice`) or, in tests, a CPU stand-in with delayed copies.

Ordering: copies run on side streams. A host->device copy waits for an event (the last compute
use of the destination buffer, recorded when the buffer was let go); the compute stream waits
for the copy's event before the module runs. A device->host copy is ordered after the work
queued on the compute stream (the kernels that produced the gradient). Events are opaque.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["ComputeDevice", "CudaDevice"]


class ComputeDevice(Protocol):
    """Device memory and copies for the device path (see the module doc).

    Thread-safety: called under the offload's lock, from the training thread and autograd's
    device thread. Buffer lifetime: a source or destination must stay alive and unchanged
    until its copy's event is done (the caller keeps it).
    """

    device: torch.device

    def empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 device buffer of ``nbytes`` (allocated on the compute stream)."""
        ...

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of ``nbytes`` that asynchronous copies can use (page-locked)."""
        ...

    def placeholder(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor of ``shape`` holding one element (NaN for floating types)."""
        ...

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any) -> Any:
        """Start copying host ``src`` into device ``dst`` on the side stream once the event
        ``after`` (None: none) happened; the copy's event."""
        ...

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start copying device ``src`` into host ``dst`` after the work queued on the compute
        stream; the copy's event."""
        ...

    def compute_wait(self, event: Any) -> None:
        """Make the compute stream wait for ``event`` (without blocking the host)."""
        ...

    def compute_mark(self) -> Any:
        """An event at the end of the work queued on the compute stream now."""
        ...

    def done(self, event: Any) -> bool:
        """True if ``event`` happened (None counts as done); does not block."""
        ...

    def synchronize(self, event: Any) -> None:
        """Block the host until ``event`` happened (None: return at once); raise its error."""
        ...


class CudaDevice:
    """:class:`ComputeDevice` on one CUDA device: one side stream per direction, so parameter
    copies in and gradient copies out overlap each other and the compute stream (the stream
    current when a hook runs: the default one unless the training loop chose another)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaDevice needs a CUDA device, got {device}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                                   else device.index)
        self._in = torch.cuda.Stream(self.device)
        self._out = torch.cuda.Stream(self.device)
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def placeholder(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        base = self._placeholders.get(dtype)
        if base is None:
            fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
            base = self._placeholders[dtype] = torch.full((1,), fill, dtype=dtype,
                                                          device=self.device)
        return base.expand(shape) if len(shape) else base.view(())

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any) -> Any:
        if after is not None:
            self._in.wait_event(after)
        with torch.cuda.stream(self._in):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self._in)
        return event

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        self._out.wait_stream(self._compute())
        with torch.cuda.stream(self._out):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self._out)
        return event

    def compute_wait(self, event: Any) -> None:
        if event is not None:
            self._compute().wait_event(event)

    def compute_mark(self) -> Any:
        event = torch.cuda.Event()
        event.record(self._compute())
        return event

    def done(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def synchronize(self, event: Any) -> None:
        if event is not None:
            event.synchronize()
