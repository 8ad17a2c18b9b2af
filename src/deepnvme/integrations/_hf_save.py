"""Shard writes of transformers' ``save_pretrained`` done by :func:`deepnvme.save_safetensors`
(shared by :mod:`.transformers` and its Trainer)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ..checkpoint.safetensors import save_safetensors
from ..config import IOConfig

try:
    import transformers
    from transformers import modeling_utils
except ImportError as exc:  # pragma: no cover - imported by the transformers integration's users only
    raise ImportError("deepnvme.integrations.transformers needs transformers and accelerate: "
                      "pip install 'deepnvme[inference]'") from exc

__all__ = ["writes_through_deepnvme"]

_save_lock = threading.Lock()


def _deepnvme_save_file(io_config: IOConfig | Mapping[str, Any] | None) -> Callable[..., None]:
    def save_file(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
        save_safetensors(tensors, filename, metadata, config=io_config)
    return save_file


@contextmanager
def writes_through_deepnvme(io_config: IOConfig | Mapping[str, Any] | None = None) -> Iterator[None]:
    """Within the block, the safetensors shards that transformers' ``save_pretrained`` writes are
    written by :func:`deepnvme.save_safetensors` (one block at a time in the process: the hook
    is transformers' module-level ``safe_save_file``)."""
    if not callable(getattr(modeling_utils, "safe_save_file", None)):
        raise RuntimeError(f"transformers {transformers.__version__} has no modeling_utils.safe_save_file; "
                           "this version's save_pretrained cannot write through deepnvme")
    with _save_lock:
        original = getattr(modeling_utils, "safe_save_file")  # noqa: B009 (not exported: no static access)
        setattr(modeling_utils, "safe_save_file", _deepnvme_save_file(io_config))  # noqa: B010
        try:
            yield
        finally:
            setattr(modeling_utils, "safe_save_file", original)  # noqa: B010
