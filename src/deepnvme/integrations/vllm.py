"""vLLM's ``load_format="deepnvme"``: safetensors weights read with deepnvme's engine.

vLLM calls :func:`register` in each of its processes through the ``vllm.general_plugins`` entry
point, so ``LLM(model=DIR, load_format="deepnvme")`` and ``--load-format deepnvme`` work with no
import. ``model_loader_extra_config`` takes deepnvme I/O settings and ``read_window`` (see
:func:`deepnvme.integrations._weights.loader_options`). Memory: vLLM's model plus at most
``2 x max(read_window, largest tensor)`` bytes of read buffers (the stream's bound). This module
imports vLLM; nothing in ``deepnvme`` imports it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ..errors import DeepNVMeError
from ._weights import LoaderOptions, checkpoint_tensors, loader_options, stream_weights

__all__ = ["LOAD_FORMAT", "DeepNVMeModelLoader", "register"]

log = logging.getLogger(__name__)

LOAD_FORMAT = "deepnvme"


class DeepNVMeModelLoader(BaseModelLoader):  # type: ignore[misc]
    """Streams a local folder's safetensors checkpoint into ``model.load_weights``, then checks,
    as vLLM's default loader does, that every parameter of an unquantized model was loaded."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options: LoaderOptions = loader_options(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing is downloaded: check the model is a local folder with a safetensors checkpoint."""
        checkpoint_tensors(model_config.model)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        if getattr(model, "secondary_weights", ()):
            raise DeepNVMeError(f"load_format {LOAD_FORMAT!r} reads one checkpoint folder; "
                                f"{type(model).__name__} also loads weights from other sources "
                                "(secondary_weights): use load_format 'safetensors'")
        load = getattr(model, "load_weights", None)
        if not callable(load):
            raise DeepNVMeError(f"{type(model).__name__} has no load_weights(weights) method, which "
                                f"load_format {LOAD_FORMAT!r} feeds; it is not a vLLM model")
        t0 = time.perf_counter()
        weights = stream_weights(model_config.model, self.options)
        try:
            loaded = load(weights)
        finally:
            weights.close()   # if load_weights stopped early: end the read in flight and the engine
        log.info("deepnvme: loaded the weights of %s in %.2f s", model_config.model,
                 time.perf_counter() - t0)
        if model_config.quantization is None and loaded is not None:
            # vLLM's own rule and message: every named parameter must come from the checkpoint
            tracker = DefaultModelLoader(LoadConfig(load_format="safetensors"))
            tracker.track_weights_loading(model, loaded, quantized=False)


def register(**_: Any) -> None:
    """The ``vllm.general_plugins`` entry point: make ``load_format="deepnvme"`` known to vLLM.
    Safe to call more than once (vLLM loads plugins once per process)."""
    register_model_loader(LOAD_FORMAT)(DeepNVMeModelLoader)
