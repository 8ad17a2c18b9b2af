"""Shared fixtures: small tensors, a scratch directory on a real disk, fd counting."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

import deepnvme
from deepnvme.io import engine as _engine_module
from deepnvme.io.movers import probe_engines, select_engine, select_movers

settings.register_profile("deepnvme", deadline=None, max_examples=100)
settings.load_profile("deepnvme")


AVAILABLE_ENGINES = tuple(p.name for p in probe_engines() if p.available)

# Tests under these paths run once per available engine: every handle they build with
# engine "auto" (the default, explicit IOConfigs included) uses that engine.
_PER_ENGINE = ("tests/conformance/", "tests/functional/io/", "tests/unit/io/",
               "tests/functional/handles/", "tests/functional/swap/", "tests/functional/optim/",
               "tests/functional/memory/", "tests/functional/checkpoint/test_save_load.py",
               "tests/functional/checkpoint/test_async_save.py")


# Tests under these paths run batches of small direct reads both ways: on the small-read
# queues (deepnvme.io.small) and through the dispatch window's gathered requests.
_BOTH_READ_PATHS = ("tests/functional/io/test_gathered_faults.py", "tests/functional/io/test_kept_files.py",
                    "tests/functional/io/test_missing_paths.py", "tests/functional/io/test_volume.py",
                    "tests/functional/io/test_auto_choice.py", "tests/functional/handles/test_handle_batches.py",
                    "tests/functional/data/")


def pytest_generate_tests(metafunc):
    path = str(metafunc.definition.path).replace(os.sep, "/")
    if "small_reads" in metafunc.fixturenames and any(p in path for p in _BOTH_READ_PATHS):
        metafunc.parametrize("small_reads", ("small", "window"), indirect=True)
    if getattr(metafunc.module, "ENGINE_SPECIFIC", False):  # the module picks its engines
        return
    if "io_engine" in metafunc.fixturenames and any(p in path for p in _PER_ENGINE):
        engines = AVAILABLE_ENGINES
        if "tests/conformance/" in path and len(select_movers("auto")) > 1:
            engines += ("auto",)  # and auto itself, several movers picked per transfer
        metafunc.parametrize("io_engine", engines, indirect=True)


@pytest.fixture(autouse=True)
def io_engine(request, monkeypatch):
    """The engine that ``auto`` means for this test (parametrized for the paths above)."""
    chosen = getattr(request, "param", None)
    if chosen == "auto":
        return chosen
    if chosen is not None:
        monkeypatch.setattr(_engine_module, "select_engine",
                            lambda requested: chosen if requested == "auto" else select_engine(requested))
        monkeypatch.setattr(_engine_module, "select_movers",
                            lambda requested: (chosen,) if requested == "auto" else select_movers(requested))
    return chosen or select_engine("auto")


@pytest.fixture(autouse=True)
def small_reads(request, monkeypatch):
    """Whether batches of small direct reads take the small-read queues ("small", the default)
    or the dispatch window ("window"); parametrized for the paths above."""
    from deepnvme.io import small
    chosen = getattr(request, "param", "small")
    monkeypatch.setattr(small, "ENABLED", chosen == "small")
    return chosen


@pytest.fixture(scope="session")
def _load_path_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("deepnvme-cache"))


@pytest.fixture(autouse=True)
def load_path_cache(_load_path_cache_dir, monkeypatch):
    """Load-path choices (deepnvme.checkpoint._load_path) cached in a scratch folder, never the
    user's ~/.cache, and forgotten by the process between tests."""
    from deepnvme.checkpoint import _load_path
    monkeypatch.setenv("DEEPNVME_CACHE_DIR", _load_path_cache_dir)
    _load_path.forget()
    yield _load_path_cache_dir
    _load_path.forget()


@pytest.fixture
def handle():
    h = deepnvme.AioHandle(block_size=64 * 1024, queue_depth=8, intra_op_parallelism=2)
    yield h
    h.close()


def random_tensor(numel: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),),
                         dtype=torch.uint8, generator=g).view(dtype)


def open_fds(*, rings: bool = False) -> int:
    """Open file descriptors of this process: files and sockets, or (``rings=True``) io_uring
    instances, counted apart because engines keep one per worker until they close."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        count += (target == "anon_inode:[io_uring]") == rings
    return count


def shm_dir(tmp_name: str) -> str | None:
    """A directory on tmpfs (/dev/shm) when one is writable, else None."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        path = os.path.join("/dev/shm", tmp_name)
        os.makedirs(path, exist_ok=True)
        return path
    return None


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal says NaN != NaN, random bytes make NaNs)."""
    return torch.equal(deepnvme.cast_to_byte_tensor(a.contiguous()), deepnvme.cast_to_byte_tensor(b.contiguous()))
