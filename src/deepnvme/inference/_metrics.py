"""Process measurements for inference runs: peak RSS (anonymous and file-backed), disk reads."""

from __future__ import annotations

import threading

__all__ = ["RssSampler", "disk_read_bytes"]


def _status_kib(fields: tuple[str, ...]) -> dict[str, int]:
    out = dict.fromkeys(fields, 0)
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


def disk_read_bytes() -> int:
    """Bytes this process caused to be read from storage (``/proc/self/io`` read_bytes; counts
    O_DIRECT and page-cache misses, not cache hits); 0 where unavailable."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class RssSampler:
    """Samples ``RssAnon``/``RssFile`` every ``interval`` seconds on a thread while active
    (context manager); peaks in bytes. Short spikes between samples can be missed."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak_anon = 0
        self.peak_file = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        kib = _status_kib(("RssAnon", "RssFile"))
        self.peak_anon = max(self.peak_anon, kib["RssAnon"] * 1024)
        self.peak_file = max(self.peak_file, kib["RssFile"] * 1024)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> RssSampler:
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="deepnvme-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
