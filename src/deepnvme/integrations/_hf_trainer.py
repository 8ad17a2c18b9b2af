"""``deepnvme.integrations.transformers.Trainer``: transformers' Trainer with deepnvme checkpoint I/O.

Imported on first use of that name (``transformers.Trainer`` takes seconds to import).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import transformers
from transformers import trainer as _trainer_module
from transformers.utils.import_utils import is_sagemaker_mp_enabled, is_torch_xla_available

from ..checkpoint.inplace import load_into
from ..checkpoint.loader import load
from ..checkpoint.saver import save
from ..config import IOConfig
from ._hf_save import writes_through_deepnvme

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

_OPTIMIZER = getattr(_trainer_module, "OPTIMIZER_NAME", "optimizer.pt")
_SCHEDULER = getattr(_trainer_module, "SCHEDULER_NAME", "scheduler.pt")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


class Trainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose checkpoints go through deepnvme, in the Trainer's own
    folder layout (``checkpoint-N/``: ``model.safetensors`` or its shards and index,
    ``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``, RNG states), so
    ``resume_from_checkpoint`` and ``save_total_limit`` work as before, and this Trainer and
    transformers' own read each other's checkpoints.

    The model's safetensors shards are written by :func:`deepnvme.save_safetensors` (through
    ``save_pretrained``), the optimizer and scheduler states by :func:`deepnvme.save`; on resume
    the model is filled in place by :func:`deepnvme.load_into` and the optimizer and scheduler
    states read by :func:`deepnvme.load`. Single-process and plain data-parallel runs only:
    under DeepSpeed, FSDP, XLA or SageMaker the Trainer's own code runs unchanged. Saves block
    as the Trainer's own do. ``deepnvme_config``: deepnvme I/O settings.
    """

    def __init__(self, *args: Any, deepnvme_config: IOConfig | Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deepnvme_config = deepnvme_config

    def _deepnvme_handles_it(self) -> bool:
        """Whether this run is one deepnvme's paths cover (no sharded or special backend)."""
        special = (getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False)
                   or is_torch_xla_available() or is_sagemaker_mp_enabled())
        return not special

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        with writes_through_deepnvme(self.deepnvme_config):
            super()._save(output_dir, state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        optimizer, scheduler = self.optimizer, self.lr_scheduler
        if optimizer is None or scheduler is None or not self._deepnvme_handles_it():
            super()._save_optimizer_and_scheduler(output_dir)
            return
        if not self.args.should_save:
            return
        save(optimizer.state_dict(), os.path.join(output_dir, _OPTIMIZER), config=self.deepnvme_config)
        with _quiet_scheduler():
            save(scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER), config=self.deepnvme_config)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        target = self.model if model is None else model
        has_weights = any(os.path.isfile(os.path.join(resume_from_checkpoint, f)) for f in _WEIGHT_FILES)
        if not (self._deepnvme_handles_it() and has_weights
                and isinstance(target, transformers.PreTrainedModel)):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        result = load_into(target, resume_from_checkpoint, strict=False, config=self.deepnvme_config)
        if result.missing_keys or result.unexpected_keys:
            log.warning("resume from %s: missing %s, unexpected %s", resume_from_checkpoint,
                        result.missing_keys, result.unexpected_keys)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        files = [os.path.join(checkpoint, name) for name in (_OPTIMIZER, _SCHEDULER)] if checkpoint else []
        optimizer, scheduler = self.optimizer, self.lr_scheduler
        if (optimizer is None or scheduler is None or not files or not self._deepnvme_handles_it()
                or not all(os.path.isfile(f) for f in files)):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        device = self.args.device
        map_location = device if self.args.world_size > 1 and device.type != "cpu" else "cpu"
        optimizer.load_state_dict(load(files[0], map_location, config=self.deepnvme_config))
        with _quiet_scheduler():
            scheduler.load_state_dict(load(files[1], config=self.deepnvme_config))



@contextlib.contextmanager
def _quiet_scheduler() -> Iterator[None]:
    """Silence the scheduler's "also save or load the state of the optimizer" warning, as the
    Trainer does (it saves and loads both)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*state of the optimizer")
        yield
