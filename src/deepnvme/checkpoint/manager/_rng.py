"""Random number generator states for :class:`~deepnvme.CheckpointManager`: capture and restore.

Captured: torch's CPU generator, every CUDA device's generator when CUDA is already initialised
(never initialised here), Python's ``random`` and NumPy's legacy global generator when NumPy is
importable. Everything is stored as tensors, ints, floats and tuples, so the checkpoint loads
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """The current generator states (copies; later draws do not change them)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if importlib.util.find_spec("numpy") is not None:
        import numpy as np

        legacy: Any = np.random.get_state(legacy=True)
        name, key, pos, has_gauss, cached = legacy
        states["numpy"] = {"name": str(name), "key": torch.from_numpy(key.astype(np.int64)),
                           "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return states


def restore_rng(states: dict[str, Any]) -> None:
    """Set every generator whose state is in ``states`` (as :func:`capture_rng` made it).

    A CUDA state is restored only when this process sees CUDA; a NumPy state only when NumPy is
    importable (both are skipped otherwise, as they cannot matter to this process).
    """
    torch.set_rng_state(states["torch"])
    python = states["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states and importlib.util.find_spec("numpy") is not None:
        import numpy as np

        st = states["numpy"]
        np.random.set_state((st["name"], st["key"].numpy().astype(np.uint32), st["pos"],
                             st["has_gauss"], st["cached_gaussian"]))
