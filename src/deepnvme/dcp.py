"""``torch.distributed.checkpoint`` storage on deepnvme's engine (public path; the plugin lives
in :mod:`deepnvme.checkpoint.dcp`). Importing this module imports torch.distributed.checkpoint."""

from .checkpoint.dcp import NVMeStorageReader, NVMeStorageWriter

__all__ = ["NVMeStorageReader", "NVMeStorageWriter"]
