"""Old public names kept for one release: each warns once per process, then works as the new one.

``warn_once`` is the single ledger (a name warns once however it is reached); ``module_aliases``
builds a module's PEP 562 ``__getattr__`` for renamed attributes; ``renamed_keywords`` maps old
keyword arguments of a function onto their new names. Thread-safe; nothing runs at import.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

__all__ = ["module_aliases", "renamed_keywords", "warn_once"]

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
_warned: set[str] = set()


def warn_once(key: str, message: str, *, stacklevel: int = 2) -> bool:
    """Issue ``message`` as a :class:`DeprecationWarning` the first time ``key`` is seen in this
    process; True if it warned now. ``stacklevel`` counts from the caller of ``warn_once``."""
    with _lock:
        if key in _warned:
            return False
        _warned.add(key)
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)
    return True


def module_aliases(module: str, renamed: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving each old name of ``renamed`` (old -> new attribute of
    ``module``) with a one-time warning; other names raise :class:`AttributeError` as usual."""

    def __getattr__(name: str) -> Any:
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_once(f"{module}.{name}", f"{module}.{name} is deprecated and will be removed in the "
                  f"next release; use {module}.{new}", stacklevel=2)
        return getattr(sys.modules[module], new)

    return __getattr__


def renamed_keywords(**renamed: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function so each old keyword (``old="new"``) still works, with a one-time
    warning; passing both the old and the new keyword raises :class:`TypeError`."""

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        where = f"{func.__module__}.{func.__qualname__}"

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            for old, new in renamed.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{where}() got both {old}= (deprecated) and {new}=; pass {new}= only")
                warn_once(f"{where}({old}=)", f"{where}(): the keyword {old}= is deprecated and will "
                          f"be removed in the next release; use {new}=", stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return func(*args, **kwargs)

        return wrapper

    return decorate
