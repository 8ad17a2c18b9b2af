"""Per-tensor checksums of manager checkpoints: algorithm choice, tensor naming, computing.

Algorithms: ``"crc32c"`` (the ``crc32c`` package: CRC-32C with SSE4.2/ARMv8 instructions,
software otherwise) and ``"xxh64"`` (the ``xxhash`` package). Both ship wheels, hash a
``memoryview`` without copying and release the GIL while hashing. ``checksums=True`` means
``"crc32c"``. Neither is a hard dependency: ``pip install deepnvme[checksums]``.

One checksum per stored storage (a tensor and its views share one), keyed by the first name
that reaches it in :func:`named_storages`' walk order, which loading reproduces.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...memory.views import byte_view, storage_bytes
from .._tree import named_storages

__all__ = ["ALGORITHMS", "resolve_algorithm", "hasher", "named_storages", "record_names", "checksum",
           "file_checksum", "Running"]

# algorithm -> (module, function taking a buffer and returning an int)
ALGORITHMS: dict[str, tuple[str, str]] = {"crc32c": ("crc32c", "crc32c"),
                                          "xxh64": ("xxhash", "xxh64_intdigest")}


def resolve_algorithm(checksums: bool | str) -> str | None:
    """The algorithm name for the manager's ``checksums`` option (None: off); checks it is usable."""
    if checksums is False:
        return None
    name = "crc32c" if checksums is True else checksums
    if name not in ALGORITHMS:
        raise ValueError(f"CheckpointManager: checksums must be True, False or one of "
                         f"{sorted(ALGORITHMS)}, got {checksums!r}")
    hasher(name)
    return name


def hasher(name: str) -> Callable[[Any], int]:
    """The hashing function of algorithm ``name``; ImportError naming the package to install."""
    module, func = ALGORITHMS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError:
        raise ImportError(f"checksums {name!r} need the {module!r} package: pip install {module} "
                          "(or pip install deepnvme[checksums])") from None
    fn: Callable[[Any], int] = getattr(mod, func)
    return fn


def checksum(fn: Callable[[Any], int], data: torch.UntypedStorage | torch.Tensor) -> int:
    """``fn`` over the bytes of a storage (or a contiguous uint8 CPU tensor), without a copy."""
    tensor = storage_bytes(data) if isinstance(data, torch.UntypedStorage) else data
    return fn(byte_view(tensor))


class Running:
    """A checksum fed in pieces, in order (the same value as hashing the bytes in one call).
    Not thread-safe."""

    def __init__(self, algorithm: str) -> None:
        self._fn = hasher(algorithm)  # the install hint, if the package is missing
        self.algorithm = algorithm
        self._crc = 0
        self._xx: Any = None
        if algorithm == "xxh64":
            import xxhash

            self._xx = xxhash.xxh64()

    def update(self, data: Any) -> None:
        """Add the bytes of a buffer (a ``memoryview``, bytes)."""
        if self._xx is not None:
            self._xx.update(data)
        else:
            self._crc = self._fn(data, self._crc)  # type: ignore[call-arg]

    def value(self) -> int:
        return int(self._xx.intdigest()) if self._xx is not None else int(self._crc)


def file_checksum(algorithm: str, path: str, *, chunk: int = 8 << 20) -> int:
    """The ``algorithm`` checksum of the whole file ``path``, read in ``chunk``-byte pieces (memory:
    one chunk); the same value as hashing the file's bytes in one call."""
    running = Running(algorithm)
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            running.update(view[:n])
    return running.value()


def record_names(saved: Mapping[str, Any], layout: Any) -> tuple[dict[str, str], list[str]]:
    """Each storage record's tensor name, and the names in walk order (the manifest's)."""
    by_storage: dict[int, str] = {}
    for name, storage in named_storages(saved):
        by_storage.setdefault(storage._cdata, name)
    names: dict[str, str] = {}
    for key, (storage, _) in layout.items.items():
        found = by_storage.get(storage._cdata)
        if found is None:
            raise ValueError(f"CheckpointManager.save: a tensor (record {key}) sits inside an object "
                             "other than a dict, list or tuple; keep tensors in those containers")
        names[key] = found
    used = set(names.values())
    order = [n for n in by_storage.values() if n in used]
    return names, order
