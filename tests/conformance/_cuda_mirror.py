"""The conformance suite with CUDA tensors: handles whose every request moves a CUDA copy of the
test's CPU tensor (written from it, or read into it and copied back before the request ends),
so each CPU assertion checks the device path. Used only where CUDA is available."""

from __future__ import annotations

from concurrent.futures import Future

import torch

import deepnvme
from deepnvme.memory.views import check_io_tensor


class _Mirror:
    def _submit(self, write, buffer, target, offset, validate, fsync=None, *, track,
                keep_open=False):
        if not (isinstance(buffer, torch.Tensor) and buffer.is_cpu):
            return super()._submit(write, buffer, target, offset, validate, fsync, track=track,
                                   keep_open=keep_open)
        check_io_tensor(buffer)  # the CPU tensor's own errors, as the CPU suites expect them
        device = buffer.to("cuda")
        inner = super()._submit(write, device, target, offset, validate, fsync, track=False)
        outer: Future[int] = Future()
        outer.set_running_or_notify_cancel()  # started, like the inner request: not cancellable

        def finish(f: Future[int]) -> None:
            exc = f.exception()
            if exc is not None:
                outer.set_exception(exc)
                return
            try:
                if not write:
                    buffer.copy_(device.cpu())
            except BaseException as copy_exc:  # noqa: BLE001 - goes to the future
                outer.set_exception(copy_exc)
                return
            outer.set_result(f.result())
        inner.add_done_callback(finish)
        if track:
            with self._lock:
                self._pending.append(outer)
        return outer


class CudaMirrorAio(_Mirror, deepnvme.AioHandle):
    """AioHandle's pinned staging pipeline with CUDA tensors."""


class CudaMirrorGds(_Mirror, deepnvme.GdsHandle):
    """GdsHandle's cuFile path with CUDA tensors."""


def backends() -> dict:
    if not torch.cuda.is_available():
        return {}
    found = {
        "cuda-staged-p2": lambda: CudaMirrorAio(block_size=64 * 1024, queue_depth=8,
                                                intra_op_parallelism=2),
    }
    if deepnvme.gds_status().available:
        found["cuda-gds-p2"] = lambda: CudaMirrorGds(block_size=64 * 1024, queue_depth=8,
                                                     intra_op_parallelism=2)
    return found
