"""Weight-streaming inference: run models larger than memory with weights read from NVMe.

:func:`stream_weights` moves an in-memory model's block weights to a file; :func:`load_streamed`
builds a transformers model without materialising its weights and streams them from the
safetensors checkpoint (or an aligned copy in ``packed_dir``). Both install hooks that prefetch
upcoming blocks while the current one computes. :func:`run_generate` measures tokens/s of such
a model. ("Offload" is the training sense: :func:`deepnvme.offload_parameters`.)
"""

from .._deprecation import module_aliases
from ._streamer import StreamStats, WeightStreamer
from .generate import GenerateResult, run_generate
from .install import stream_stats, stream_weights, streamer_of
from .pretrained import load_streamed

__all__ = ["GenerateResult", "StreamStats", "WeightStreamer", "load_streamed", "run_generate",
           "stream_stats", "stream_weights", "streamer_of"]

__getattr__ = module_aliases(__name__, {"offload": "stream_weights", "load_offloaded": "load_streamed"})
