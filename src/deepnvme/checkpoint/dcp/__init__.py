"""``torch.distributed.checkpoint`` storage on deepnvme's engine: :class:`NVMeStorageWriter` and
:class:`NVMeStorageReader` (:mod:`._storage`), their write streams and parsers (:mod:`._io`) and
the reader's planning of spans and slices (:mod:`._read`). Importing this package imports
torch.distributed.checkpoint."""

from ._storage import NVMeStorageReader, NVMeStorageWriter

__all__ = ["NVMeStorageReader", "NVMeStorageWriter"]
