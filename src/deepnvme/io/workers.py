"""Worker threads around one work queue, with the lifecycle the engine and the staging
pipeline share: lazy start, admit-or-refuse under one lock, drain, stop.

The order in :meth:`WorkerGroup.close` is what makes closing safe while other threads submit:
refuse new work first (under the lock that admission takes), then wait for what was admitted,
then stop the threads. Items in flight must have a ``future`` attribute.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["WorkerGroup"]


class WorkerGroup:
    """``lock`` guards admission; ``open`` holds admitted items until their future completes."""

    def __init__(self, *, name: str, closed_message: str) -> None:
        self.name = name
        self.closed_message = closed_message
        self.lock = threading.Lock()
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.open: set[Any] = set()
        self.closed = False

    def check_open(self) -> None:
        """Raise ``RuntimeError`` if closing has begun (call under :attr:`lock` to be exact)."""
        if self.closed:
            raise RuntimeError(self.closed_message)

    def start(self, count: int, target: Callable[..., None], args: Callable[[int], tuple[Any, ...]]) -> None:
        """Start threads up to ``count``; caller holds :attr:`lock`. ``args(i)`` gives thread
        i's arguments."""
        while len(self.threads) < count:
            i = len(self.threads)
            th = threading.Thread(target=target, args=args(i), name=f"{self.name}-{i}", daemon=True)
            th.start()
            self.threads.append(th)

    def drain(self) -> None:
        """Block until every admitted item has completed (errors stay on their futures)."""
        with self.lock:
            items = list(self.open)
        for item in items:
            item.future.exception()

    def close(self) -> bool:
        """Refuse new work, drain, stop the threads. Returns False if already closed.
        Not callable from one of the group's own threads (a future's done-callback)."""
        if threading.current_thread() in self.threads:
            raise RuntimeError(f"{self.name}: cannot be closed from its own worker thread (e.g. "
                               "in a future's done-callback); close it from another thread")
        with self.lock:
            already, self.closed = self.closed, True
        self.drain()
        if already:
            return False
        with self.lock:
            threads, self.threads = self.threads, []
        for _ in threads:
            self.queue.put(None)
        for th in threads:
            th.join()
        return True
