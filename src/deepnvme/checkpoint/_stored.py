"""Where each tensor of a checkpoint lives, as the checkpoint package names it.

The readers live in :mod:`deepnvme.formats`: :mod:`~deepnvme.formats.torchsave` for torch.save
files and :mod:`~deepnvme.formats.index` for a file or folder (one rule for duplicates and the
shard index); this module keeps the names the checkpoint modules import.
"""

from __future__ import annotations

from ..formats.safetensors import StoredTensor
from ..formats.torchsave import torch_layout, torch_skeleton

__all__ = ["StoredTensor", "torch_layout", "torch_skeleton"]
