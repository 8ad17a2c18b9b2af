"""Fenced saves with copy-on-fence: the copied path, the waited path (no staging), a staging
budget that holds only part, a storage torn while in flight, the write order, and checksums;
every checkpoint must equal the state at save() bitwise while the loop changes it after."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import deepnvme
from deepnvme.checkpoint import _fence
from deepnvme.handles.aio import AioHandle


def _setup(seed: int = 0):
    """A model whose weights and Adam state are storages over 256 KiB (written from live memory)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(384, 384), torch.nn.ReLU(), torch.nn.Linear(384, 384),
                                torch.nn.Linear(384, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt)
    return model, opt


def _train(model, opt, steps=1):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 384)).pow(2).mean().backward()
        opt.step()


def _bits(obj):
    if isinstance(obj, torch.Tensor):
        return (str(obj.dtype), tuple(obj.shape), obj.contiguous().reshape(-1).view(torch.uint8).clone())
    if isinstance(obj, dict):
        return {k: _bits(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_bits(v) for v in obj]
    return obj


def _same(a, b) -> bool:
    if isinstance(a, tuple) and len(a) == 3 and isinstance(a[2], torch.Tensor):
        return a[:2] == b[:2] and torch.equal(a[2], b[2])
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _slow_takes(monkeypatch, delay: float, events: list) -> None:
    """One storage per write request, each starting ``delay`` s late; "written" once all are."""
    monkeypatch.setattr(_fence, "_BATCH", 1)
    take, finish = _fence.FencedWrite.take, _fence.FencedWrite.finish

    def slow_take(self):
        time.sleep(delay)
        return take(self)

    def noting_finish(self, batch, sums):
        ending = {id(e) for e, _ in batch}
        if not any(e.torn for e, _ in batch) and all(e.state == _fence.DONE or id(e) in ending
                                                     for e in self.entries):
            events.append("written")
        finish(self, batch, sums)

    monkeypatch.setattr(_fence.FencedWrite, "take", slow_take)
    monkeypatch.setattr(_fence.FencedWrite, "finish", noting_finish)


def _want(model, opt, extra):
    return {"model": _bits(model.state_dict()), "opt": _bits(opt.state_dict()), "extra": _bits(extra)}


def _check(tmp_path, want, step=1):
    got = deepnvme.CheckpointManager(tmp_path).load(step)  # checksums (when stored) are verified
    assert _same(_bits({k: got[k] for k in want}), want)


@pytest.mark.parametrize("checksums", [False, "crc32c"])
def test_copied_path_lets_the_step_go_on_and_saves_the_state_at_save(tmp_path, monkeypatch, checksums):
    events: list = []
    _slow_takes(monkeypatch, 0.3, events)  # about 2.4 s for the save's eight requests
    model, opt = _setup()
    extra = torch.randn(300_000)  # no optimizer changes it: copied at the fence too
    want = _want(model, opt, extra)
    with deepnvme.CheckpointManager(tmp_path, staging="fenced", checksums=checksums) as mgr:
        mgr.save(1, {"model": model, "opt": opt, "extra": extra})
        _train(model, opt, steps=3)  # the first step() copies what is not written and goes on
        with torch.no_grad():
            extra.add_(1.0)  # allowed once the fenced step has run
            model[0].weight.mul_(-1.0)
        assert events == []  # the steps ran before the write ended
        assert mgr.stats.fence_copied_bytes > 2 * 384 * 384 * 4
        mgr.wait()
    assert events == ["written"]
    _check(tmp_path, want)


def test_waited_path_without_staging(tmp_path, monkeypatch):
    events: list = []
    _slow_takes(monkeypatch, 0.05, events)
    model, opt = _setup()
    extra = torch.randn(300_000)
    want = _want(model, opt, extra)
    opt.register_step_post_hook(lambda *a: events.append("stepped"))
    with deepnvme.CheckpointManager(tmp_path, staging=deepnvme.FencedStager(staging_bytes=0)) as mgr:
        mgr.save(1, {"model": model, "opt": opt, "extra": extra})
        _train(model, opt)  # step() waits until every storage is written
        assert events[:2] == ["written", "stepped"]
        assert mgr.stats.fence_copied_bytes == 0 and mgr.stats.fence_wait_seconds > 0.1
        with torch.no_grad():
            extra.add_(1.0)
        mgr.wait()
    _check(tmp_path, want)


def test_partial_staging_copies_the_last_and_waits_for_the_first(tmp_path, monkeypatch, caplog):
    # eight requests 0.25 s apart: the step's fence finds at least four unwritten if it comes
    # within a second of save() (with 0.05 s, a loaded CI machine once reached it too late)
    _slow_takes(monkeypatch, 0.25, [])
    model, opt = _setup()
    extra = torch.arange(10)
    want = _want(model, opt, extra)
    budget = 3 * 384 * 384 * 4 + 4096  # room for three 384 x 384 float32 storages, not four
    with caplog.at_level(logging.DEBUG, logger="deepnvme.checkpoint._fence"):
        with deepnvme.CheckpointManager(tmp_path, staging=deepnvme.FencedStager(staging_bytes=budget)) as mgr:
            mgr.save(1, {"model": model, "opt": opt, "extra": extra})
            _train(model, opt, steps=2)
            assert mgr.stats.fence_copied_bytes == 3 * 384 * 384 * 4  # the last three in write order
            assert mgr.stats.fence_wait_seconds > 0.05  # and the step waited for the others
            mgr.wait()
    assert "the step waits for the other" in caplog.text
    _check(tmp_path, want)


def test_a_storage_in_flight_at_the_fence_is_written_again_from_its_copy(tmp_path, monkeypatch):
    model, opt = _setup()
    extra = torch.randn(300_000)
    want = _want(model, opt, extra)
    in_flight, go_on = threading.Event(), threading.Event()
    written: list[tuple[int, int]] = []  # (data_ptr, file offset) of each large write
    real = AioHandle.write_many

    def write_many(self, path, items, **kw):
        items = list(items)
        if any(buf.nbytes >= 256 * 1024 for buf, _ in items):
            written.extend((buf.data_ptr(), off) for buf, off in items)
            if not in_flight.is_set():
                in_flight.set()
                go_on.wait(10)  # the first request stays in flight until the step has changed it
        return real(self, path, items, **kw)

    monkeypatch.setattr(_fence, "_BATCH", 1)
    monkeypatch.setattr(AioHandle, "write_many", write_many)
    with deepnvme.CheckpointManager(tmp_path, staging="fenced", checksums="xxh64") as mgr:
        mgr.save(1, {"model": model, "opt": opt, "extra": extra})
        assert in_flight.wait(10)
        first = written[0]
        _train(model, opt)  # copies everything, the in-flight storage included, then changes it
        go_on.set()  # the first request now writes the changed (torn) bytes
        mgr.wait()
    offsets = [off for _, off in written]
    assert offsets.count(first[1]) == 2 and first[0] != written[-1][0]  # written again, from its copy
    assert len(offsets) == len(set(offsets)) + 1
    _check(tmp_path, want)


def test_optimizer_storages_are_written_first(tmp_path, monkeypatch):
    model, opt = _setup()
    extra = torch.randn(300_000)
    order: list[int] = []
    real = AioHandle.write_many

    def write_many(self, path, items, **kw):
        items = list(items)
        order.extend(buf.data_ptr() for buf, _ in items if buf.nbytes >= 256 * 1024)
        return real(self, path, items, **kw)

    monkeypatch.setattr(AioHandle, "write_many", write_many)
    with deepnvme.CheckpointManager(tmp_path, staging="fenced") as mgr:
        mgr.save(1, {"extra": extra, "model": model, "opt": opt})  # extra comes first in the file
        mgr.wait()
    assert order[-1] == extra.data_ptr() and len(order) == 7  # 2 weights, 4 Adam moments, extra


def test_fence_staging_bytes_is_checked(tmp_path):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="staging_bytes"):
            deepnvme.FencedStager(staging_bytes=bad)


@pytest.mark.parametrize("settle", [0.0, 0.5])
def test_precopy_copies_in_the_background_before_the_fence(tmp_path, monkeypatch, settle):
    events: list = []
    _slow_takes(monkeypatch, 0.2, events)
    model, opt = _setup()
    extra = torch.randn(300_000)
    want = _want(model, opt, extra)
    with deepnvme.CheckpointManager(tmp_path, staging=deepnvme.FencedStager(precopy=True),
                                    checksums="crc32c") as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": model, "opt": opt, "extra": extra})
            time.sleep(settle)  # 0.5 s: forward and backward long enough to copy everything
            _train(model, opt)  # the fence copies what precopy has not (settle 0: maybe all)
            with torch.no_grad():
                extra.add_(1.0)
            if step == 1:
                mgr.wait()
                stats = mgr.stats
        assert events[0] == "written"
        mgr.wait()
    if settle:
        assert stats.fence_precopied_bytes > 2 * 384 * 384 * 4 and stats.fence_copied_bytes == 0
    assert stats.fence_precopied_bytes + stats.fence_copied_bytes >= 4 * 384 * 384 * 4
    _check(tmp_path, want)


@pytest.mark.parametrize("precopy", [False, True])
def test_saving_every_step_while_the_writer_lags_ends_and_is_exact(tmp_path, monkeypatch, precopy):
    _slow_takes(monkeypatch, 0.03, [])  # the writer stays a save or two behind the loop
    model, opt = _setup()
    wants: dict[int, dict] = {}
    failed: list[BaseException] = []

    def loop() -> None:
        try:
            with deepnvme.CheckpointManager(tmp_path, staging=deepnvme.FencedStager(precopy=precopy),
                                            keep=None) as mgr:
                for step in range(1, 7):
                    wants[step] = {"model": _bits(model.state_dict()), "opt": _bits(opt.state_dict())}
                    mgr.save(step, {"model": model, "opt": opt})
                    _train(model, opt)
        except BaseException as exc:  # reported below
            failed.append(exc)

    runner = threading.Thread(target=loop, daemon=True)
    runner.start()
    runner.join(60)
    assert not runner.is_alive(), "the fenced saves deadlocked"
    assert not failed
    reader = deepnvme.CheckpointManager(tmp_path)
    for step, want in wants.items():
        got = reader.load(step)
        assert _same(_bits({k: got[k] for k in want}), want), step


def test_a_save_that_ends_while_its_fence_waits_for_the_arena_gives_it_back():
    staging = _fence.Staging(None)

    def write(n: int) -> _fence.FencedWrite:
        t = torch.zeros(1 << 16)
        return _fence.FencedWrite([_fence.Entry(key="0", storage=t.untyped_storage(), offset=0, owner=None)],
                                  [], staging)

    first, second = write(0), write(1)
    assert staging.acquire(first, 1 << 18) is not None  # an earlier save copies into the arena
    fence = threading.Thread(target=second.protect, args=(0,))
    fence.start()  # waits for the arena
    time.sleep(0.2)
    second.end()  # the second save got written meanwhile, and ends
    first.end()  # the arena is free: the waiting fence gets it after its save ended
    fence.join(10)
    assert not fence.is_alive()
    third = write(2)
    got: list = []
    taker = threading.Thread(target=lambda: got.append(staging.acquire(third, 1 << 18)))
    taker.start()
    taker.join(10)
    assert got and got[0] is not None, "the arena stayed with a save that had ended"
    staging.release(third)
    staging.close()
