"""Path arguments of the checkpoint functions: str or os.PathLike, anything else a clear TypeError."""

from __future__ import annotations

import os

__all__ = ["as_path"]


def as_path(path: object, func: str, accepted: str = "a str or os.PathLike file path") -> str:
    """``path`` as a str for ``func``; anything else is a TypeError saying what is accepted."""
    if isinstance(path, (str, os.PathLike)):
        name = os.fspath(path)
        if isinstance(name, str):
            return name
    raise TypeError(f"{func}: path must be {accepted}, got {type(path).__name__} {path!r}")
