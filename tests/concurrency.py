"""Test helpers that run code on another thread or in a forked child, failing on a hang."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any


def call_in_thread(fn: Callable[[], Any], timeout: float, hang_message: str) -> Any:
    """Run ``fn`` on a daemon thread; its result, or the exception it raised (returned, not
    raised, so the test can inspect it). Fails with ``hang_message`` if it runs past ``timeout``."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), hang_message
    return out[0]


def run_in_fork(body: Callable[[], bool], timeout: float = 60.0) -> int:
    """Run ``body`` in a forked child; its exit code: 0 if it returned True, 1 otherwise.

    A child that hangs past ``timeout`` (the bug such tests guard) is killed and the test fails.
    """
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            ok = bool(body())
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"forked child {pid} hung for {timeout} s")
