"""DeepSpeed's keyword spellings for handle methods, resolved against deepnvme's own names.

DeepSpeed's pybind methods name the async flag ``async`` (a Python keyword, so it can only
arrive through ``**kwargs``), spell the example argument ``example_tenosr`` and take an open
file descriptor as ``fd=``. Each helper accepts exactly one spelling and raises ``TypeError``
naming the arguments otherwise, as Python does for a bad call.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..io.volume import VolumePath

__all__ = ["Example", "async_flag", "example_arg", "write_target"]

#: an example tensor (its dtype is used) or a dtype
Example = torch.Tensor | torch.dtype


def _reject_unknown(method: str, extra: Mapping[str, object], allowed: tuple[str, ...] = ()) -> None:
    """Raise like Python for a keyword argument ``method`` does not take."""
    unknown = sorted(k for k in extra if k not in allowed)
    if unknown:
        raise TypeError(f"{method}() got an unexpected keyword argument {unknown[0]!r}")


def async_flag(method: str, async_op: object, extra: Mapping[str, object]) -> bool:
    """The async flag of ``pread``/``pwrite``: ``async_op`` or DeepSpeed's ``async=``, exactly one."""
    _reject_unknown(method, extra, ("async",))
    if "async" in extra:
        if async_op is not None:
            raise TypeError(f"{method}() got both 'async_op' and 'async' (DeepSpeed's name for "
                            "the same flag); pass one")
        async_op = extra["async"]
    if async_op is None:
        raise TypeError(f"{method}() missing required argument 'async_op' (or DeepSpeed's 'async')")
    if not isinstance(async_op, int):  # bool is an int; a str such as "False" is a mistake
        raise TypeError(f"{method}() argument 'async_op' must be a bool, got {type(async_op).__name__}")
    return bool(async_op)


def example_arg(method: str, example_tensor: Example | None, example_tenosr: Example | None
                ) -> Example:
    """The example given as ``example_tensor`` or as DeepSpeed's ``example_tenosr``, exactly one."""
    if example_tensor is not None and example_tenosr is not None:
        raise TypeError(f"{method}() got both 'example_tensor' and 'example_tenosr' (DeepSpeed's "
                        "spelling of the same argument); pass one")
    chosen = example_tensor if example_tensor is not None else example_tenosr
    if chosen is None:
        raise TypeError(f"{method}() missing required argument 'example_tensor' "
                        "(or 'example_tenosr')")
    return chosen


def write_target(method: str, filename: str | int | VolumePath | None,
                 fd: int | None) -> str | int | VolumePath:
    """A path, or an open descriptor given positionally or as DeepSpeed's ``fd=``."""
    if filename is not None and fd is not None:
        raise TypeError(f"{method}() got both 'filename' and 'fd'; pass one")
    if fd is not None:
        if isinstance(fd, bool) or not isinstance(fd, int):
            raise TypeError(f"{method}() argument 'fd' must be an int file descriptor, "
                            f"got {type(fd).__name__}")
        return fd
    if filename is None:
        raise TypeError(f"{method}() missing required argument 'filename' (or 'fd')")
    return filename
