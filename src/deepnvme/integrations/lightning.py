"""PyTorch Lightning: checkpoints written and read by deepnvme, as a ``CheckpointIO`` plugin.

``Trainer(plugins=[DeepNVMeCheckpointIO()])`` is all it takes: ``ModelCheckpoint`` and
``trainer.fit(ckpt_path=...)`` work unchanged. Saves are asynchronous by default, as with
Lightning's ``AsyncCheckpointIO``: ``save_checkpoint`` returns once the checkpoint is staged
(:class:`~deepnvme.AsyncCheckpointer`: the tensors are copied into a reused page-locked arena,
the pickle is written), the background writer writes the bytes, fsyncs and renames. A failed
save raises at the next ``save_checkpoint`` or at ``teardown`` (the end of ``fit``). Files are
``torch.save`` archives: Lightning's ``TorchCheckpointIO`` and ``torch.load`` read them, and
this plugin reads theirs.

This module imports Lightning (``lightning``, else ``pytorch_lightning``'s ``lightning_fabric``);
``import deepnvme`` does not import it.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

from ..checkpoint.async_saver import AsyncCheckpointer, AsyncSaveHandle
from ..checkpoint.loader import load
from ..checkpoint.saver import save
from ..config import IOConfig
from ..io import durable

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:  # the standalone pytorch-lightning / lightning-fabric packages
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[assignment]

__all__ = ["DeepNVMeCheckpointIO"]

log = logging.getLogger(__name__)


def resolve_weights_only(weights_only: bool | None) -> bool:
    """``torch.load``'s reading of ``weights_only=None``: true unless the environment says
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``; ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` forces true."""
    truthy = ("1", "y", "yes", "true")
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in truthy:
        return True
    if weights_only is not None:
        return bool(weights_only)
    return os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in truthy


def _local_path(path: object, what: str) -> str:
    """``path`` as a local file name; deepnvme does not write through fsspec URLs."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"DeepNVMeCheckpointIO.{what}: path must be a str or os.PathLike, got "
                        f"{type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"DeepNVMeCheckpointIO.{what}: path must be text, got {text!r}")
    if text.startswith("file://"):
        return text[len("file://"):]
    if "://" in text:
        raise ValueError(f"DeepNVMeCheckpointIO.{what}: {text!r} is a remote URL; deepnvme reads and "
                         "writes local files (use Lightning's TorchCheckpointIO for remote storage)")
    return text


class DeepNVMeCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves with deepnvme's parallel O_DIRECT writer and loads
    with :func:`deepnvme.load`.

    ``asynchronous`` (default true): ``save_checkpoint`` blocks only while the checkpoint is
    staged; false: it blocks until the file is durable (:func:`deepnvme.save`).
    ``max_in_flight``: saves pending at once; a save that finds that many waits for the oldest.
    Memory (asynchronous): ``max_in_flight x`` the largest checkpoint's tensor bytes of
    page-locked staging, kept until ``teardown``. ``config``: I/O settings (the checkpoint
    profile fills the rest). ``load_checkpoint`` and ``remove_checkpoint`` first wait for the
    pending saves. Used from the trainer's thread (Lightning calls it from rank 0 only).
    """

    def __init__(self, *, asynchronous: bool = True, max_in_flight: int = 1,
                 config: IOConfig | Mapping[str, Any] | None = None) -> None:
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"DeepNVMeCheckpointIO: max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self.asynchronous = bool(asynchronous)
        self.max_in_flight = max_in_flight
        self.config = config
        self._saver: AsyncCheckpointer | None = None
        self._pending: list[AsyncSaveHandle] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` (a ``torch.save`` file); in the background when
        asynchronous, after which an earlier save's failure, if any, is raised."""
        if storage_options is not None:
            raise TypeError("Trainer.save_checkpoint(..., storage_options=...) is not supported by "
                            "DeepNVMeCheckpointIO: it has no storage options")
        file = _local_path(path, "save_checkpoint")
        os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
        if not self.asynchronous:
            save(checkpoint, file, config=self.config)
            return
        if self._saver is None:
            self._saver = AsyncCheckpointer(max_in_flight=self.max_in_flight, config=self.config)
        self._pending.append(self._saver.save(checkpoint, file))
        self._raise_finished()

    def load_checkpoint(self, path: Any, map_location: Any | None = "cpu",
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Read the checkpoint at ``path`` (any ``torch.save`` file). ``map_location`` defaults to
        the CPU, as with ``TorchCheckpointIO``; ``weights_only=None`` means ``torch.load``'s default."""
        file = _local_path(path, "load_checkpoint")
        self.wait()
        if not os.path.exists(file):
            raise FileNotFoundError(f"Checkpoint file not found: {file}")
        out: dict[str, Any] = load(file, map_location, weights_only=resolve_weights_only(weights_only),
                                   config=self.config)
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (file or folder), after a pending save to it ends."""
        file = _local_path(path, "remove_checkpoint")
        target = durable.resolve_target(file)
        for handle in [h for h in self._pending if h.path == target]:
            self._pending.remove(handle)
            handle.wait()
        if os.path.isdir(file) and not os.path.islink(file):
            shutil.rmtree(file)
        elif os.path.lexists(file):
            os.remove(file)
        else:
            return
        log.debug("deepnvme: removed checkpoint %s", file)

    def wait(self) -> None:
        """Block until every pending save is durable; raise the first failure (others are logged)."""
        pending, self._pending = self._pending, []
        first: BaseException | None = None
        for handle in pending:
            try:
                handle.wait()
            except BaseException as exc:
                if first is None:
                    first = exc
                else:
                    log.error("deepnvme: asynchronous checkpoint save to %s also failed: %s", handle.path, exc)
        if first is not None:
            raise first

    def teardown(self) -> None:
        """Wait for the pending saves, free the staging memory, raise the first failure. The
        plugin can save again afterwards (a new writer starts)."""
        try:
            self.wait()
        finally:
            saver, self._saver = self._saver, None
            if saver is not None:
                saver.close()

    def _raise_finished(self) -> None:
        """Raise the error of the oldest finished failed save, without waiting for the others."""
        done = [h for h in self._pending if h.done()]
        self._pending = [h for h in self._pending if not h.done()]
        for i, handle in enumerate(done):
            try:
                handle.wait()
            except BaseException:
                self._pending[:0] = done[i + 1:]  # the next save or teardown reports those
                raise


def _register_with_standalone_fabric() -> None:
    """Let ``pytorch_lightning.Trainer`` accept the plugin too (it checks ``lightning_fabric``'s
    ``CheckpointIO``) when both packages are installed."""
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as FabricIO
    except ImportError:
        return
    FabricIO.register(DeepNVMeCheckpointIO)  # a no-op when it is the same class


_register_with_standalone_fabric()
