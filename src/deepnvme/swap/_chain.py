"""Per-key operation ordering: each I/O on a key starts once the key's previous one ended.

A swap_in of key K queued after K's swap_out reads what that write wrote; a swap_out queued
after a swap_in does not overwrite the file before it was read. Different keys have separate
chains, so their I/O overlaps. Thread-safety: :meth:`Chain.then` may be called from any thread;
ops queued concurrently run in the order their ``then`` calls took the chain's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["Chain"]

T = TypeVar("T")


class Chain:
    """The queue of one key's I/O operations (only the last one's future is kept)."""

    __slots__ = ("_lock", "_tail")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tail: Future[None] | None = None

    def then(self, start: Callable[[], Future[int]],
             settle: Callable[[BaseException | None, int], T]) -> Future[T]:
        """Queue an op: ``start()`` submits its I/O once the previous op's future is done;
        when that I/O ends (or ``start`` raises), ``settle(error, nbytes)`` gives the returned
        future's value, or raises the error to set. The next op starts after ``settle``."""
        out: Future[T] = Future()
        # ``ended`` (no value) is what the next op waits on and what ``last`` returns: the
        # chain never keeps an op's result (a read's tensor) alive. ``start`` and ``settle``
        # hold the op's tensors; Future keeps its done-callbacks after running them, so each
        # closure drops them once used, or a kept earlier future would keep them alive.
        ended: Future[None] = Future()
        todo: list[Any] = [start, settle]

        def finish(exc: BaseException | None, n: int) -> None:
            settle_op = todo[1]
            todo.clear()
            try:
                value = settle_op(exc, n)
            except BaseException as err:  # the op's failure (or settle's) goes to its future
                out.set_exception(err)
                ended.set_exception(err)
            else:
                out.set_result(value)
                ended.set_result(None)

        def on_io(f: Future[int]) -> None:
            exc = f.exception()
            finish(exc, 0 if exc is not None else f.result())

        def go(_prev: object = None) -> None:
            start_op = todo[0]
            todo[0] = None
            try:
                fut = start_op()
            except BaseException as exc:  # a submit error fails the op like an I/O error
                finish(exc, 0)
                return
            fut.add_done_callback(on_io)

        with self._lock:
            prev, self._tail = self._tail, ended
        if prev is None:
            go()
        else:
            prev.add_done_callback(go)
        return out

    def last(self) -> Future[None] | None:
        """A future ending with the op queued last (after every earlier one), with its error
        but not its value; None before any op."""
        with self._lock:
            return self._tail
