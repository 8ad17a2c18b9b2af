"""Training data from NVMe: Megatron indexed datasets (.bin + .idx) read with deep-queue direct I/O.

:class:`TokenDataset` gives fixed-length samples (a ``torch.utils.data.Dataset``, with a
prefetching :meth:`~TokenDataset.batches` reader); :func:`write_token_dataset` writes the files.
"""

from ..errors import DatasetFormatError
from .dataset import TokenDataset
from .writer import write_token_dataset

__all__ = ["DatasetFormatError", "TokenDataset", "write_token_dataset"]
