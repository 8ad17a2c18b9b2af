"""Weight-streaming inference: run models larger than memory with weights read from NVMe.

:func:`offload` moves an in-memory model's block weights to a file; :func:`load_offloaded`
builds a transformers model without materialising its weights and streams them from the
safetensors checkpoint (or an aligned copy). Both install hooks that prefetch upcoming blocks
while the current one computes. :func:`run_generate` measures tokens/s of such a model.
"""

from ._streamer import StreamStats, WeightStreamer
from .generate import GenerateResult, run_generate
from .install import offload, stream_stats, streamer_of
from .pretrained import load_offloaded

__all__ = ["GenerateResult", "StreamStats", "WeightStreamer", "load_offloaded", "offload",
           "run_generate", "stream_stats", "streamer_of"]
