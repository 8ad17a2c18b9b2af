"""DeepSpeed's ``aio_handle`` method names, as a mixin of :class:`~deepnvme.AioHandle`.

DeepSpeed users switch with one import: argument names are DeepSpeed's (``buffer``,
``filename``, ``validate``, ``file_offset``) so keyword calls written for DeepSpeed work, and
return values follow DeepSpeed (sync ops return 1, async ops 0, ``read``/``write`` 0; the
handle's ``wait()`` the number of ops completed since the last wait), but failures raise
exceptions naming the file instead of returning -1 or aborting. Every method here is a thin
call of the handle's own request path (``_submit``).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ..config import IOConfig
from ..errors import DeepNVMeIOError
from ..io.volume import VolumePath
from ..io.volume_files import striped_size
from ..memory import pinned
from ._deepspeed_args import async_flag, example_arg, write_target

__all__ = ["DeepSpeedMethods"]

_DEEPSPEED_SECTOR = 512  # DeepSpeed's assumed O_DIRECT alignment, the unit of get_alignment()


class DeepSpeedMethods:
    """DeepSpeed's getters, ``pread``/``pwrite`` and their sync/async forms, ``read``/``write``
    and locked-memory methods, over the handle's ``config`` and request path."""

    config: IOConfig

    if TYPE_CHECKING:  # provided by AioHandle
        def _submit(self, write: bool, buffer: torch.Tensor, target: str | int | VolumePath,
                    offset: int, validate: bool, fsync: bool | None = None, *, track: bool,
                    keep_open: bool = False) -> Future[int]: ...

        def _check_buffer(self, buffer: object) -> bool: ...

    # --- getters ----------------------------------------------------------------------------

    def get_block_size(self) -> int:
        return self.config.block_size

    def get_queue_depth(self) -> int:
        return self.config.queue_depth

    def get_single_submit(self) -> bool:
        return self.config.single_submit

    def get_overlap_events(self) -> bool:
        return self.config.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self.config.intra_op_parallelism

    def get_alignment(self) -> int:
        """DeepSpeed's request granularity, ``intra_op_parallelism x 512`` bytes: clients such as
        DeepSpeed's FastFileWriter size buffers and offsets by it. deepnvme needs no alignment
        from callers (it uses each file's own O_DIRECT alignment and bounces unaligned edges);
        locked tensors are aligned to ``config.alignment``."""
        return self.config.intra_op_parallelism * _DEEPSPEED_SECTOR

    # --- reads and writes ---------------------------------------------------------------
    # Argument names are DeepSpeed's (buffer, filename, validate, file_offset), so keyword calls
    # written for DeepSpeed work; pread/pwrite also take its ``async`` flag via ``**{"async": x}``.

    def pread(self, buffer: torch.Tensor, filename: str | VolumePath, validate: bool,
              async_op: bool | None = None, file_offset: int = 0, **async_kw: bool) -> int:
        """Read into ``buffer``: async returns 0 (finish with :meth:`wait`), sync returns 1.
        The flag is ``async_op`` or DeepSpeed's keyword ``async``."""
        flag = async_flag("pread", async_op, async_kw)
        return self._op(False, buffer, filename, validate, flag, file_offset)

    def pwrite(self, buffer: torch.Tensor, filename: str | int | VolumePath, validate: bool,
               async_op: bool | None = None, file_offset: int = 0, **async_kw: bool) -> int:
        """Write ``buffer``: async returns 0 (finish with :meth:`wait`), sync returns 1.
        The flag is ``async_op`` or DeepSpeed's keyword ``async``."""
        flag = async_flag("pwrite", async_op, async_kw)
        return self._op(True, buffer, filename, validate, flag, file_offset)

    def _op(self, write: bool, buffer: torch.Tensor, target: str | int | VolumePath, validate: bool,
            async_op: bool, file_offset: int) -> int:
        if async_op:
            self._submit(write, buffer, target, file_offset, validate, track=True)
            return 0
        self._submit(write, buffer, target, file_offset, validate, track=False).result()
        return 1

    def sync_pread(self, buffer: torch.Tensor, filename: str | VolumePath, file_offset: int = 0) -> int:
        return self._op(False, buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str | VolumePath, file_offset: int = 0) -> int:
        return self._op(True, buffer, filename, False, False, file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: str | VolumePath, file_offset: int = 0) -> int:
        return self._op(False, buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer: torch.Tensor, filename: str | int | VolumePath | None = None,
                     file_offset: int = 0, *, fd: int | None = None) -> int:
        """Like DeepSpeed, the file may be an open descriptor: positionally in place of
        ``filename``, or as ``fd=``. The descriptor stays open (the caller closes it)."""
        target = write_target("async_pwrite", filename, fd)
        return self._op(True, buffer, target, False, True, file_offset)

    def read(self, buffer: torch.Tensor, filename: str | VolumePath, validate: bool, file_offset: int = 0) -> int:
        """Blocking read of the rest of the file from ``file_offset``, which must be exactly
        ``buffer.nbytes`` long. Returns 0 (DeepSpeed's convention)."""
        self._check_buffer(buffer)
        nbytes = buffer.numel() * buffer.element_size()
        try:
            size = (striped_size(filename) if isinstance(filename, VolumePath)
                    else os.stat(filename).st_size)
        except OSError as exc:
            raise DeepNVMeIOError.from_oserror(exc, op="stat for read", path=str(filename),
                                               offset=file_offset, size=nbytes) from None
        if size - file_offset != nbytes:
            raise DeepNVMeIOError(f"read: buffer has {nbytes} bytes but the file holds "
                                  f"{size - file_offset} bytes from the offset (file size {size})",
                                  path=str(filename), offset=file_offset, size=nbytes)
        self._submit(False, buffer, filename, file_offset, validate, track=False).result()
        return 0

    def write(self, buffer: torch.Tensor, filename: str | VolumePath, validate: bool, file_offset: int = 0) -> int:
        """Blocking write of ``buffer`` at ``file_offset``. Returns 0 (DeepSpeed's convention)."""
        self._submit(True, buffer, filename, file_offset, validate, track=False).result()
        return 0

    # --- locked memory (shared with deepnvme.memory.pinned and PinMemoryBuilder) ----------

    def new_cpu_locked_tensor(self, num_elem: int,
                              example_tensor: torch.Tensor | torch.dtype | None = None, *,
                              example_tenosr: torch.Tensor | torch.dtype | None = None
                              ) -> torch.Tensor:
        """A 1-D page-locked CPU tensor of ``num_elem`` elements with the example's dtype
        (``example_tenosr`` is DeepSpeed's spelling of the keyword)."""
        example = example_arg("new_cpu_locked_tensor", example_tensor, example_tenosr)
        return pinned.new_cpu_locked_tensor(num_elem, example)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Release a tensor from :meth:`new_cpu_locked_tensor` now; False if it was not one."""
        return pinned.free_cpu_locked_tensor(tensor)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """True for page-locked memory: CUDA-pinned, or locked by deepnvme (any handle or
        :class:`~deepnvme.handles.deepspeed.PinMemoryBuilder`), views included."""
        return pinned.is_pinned(buffer)
