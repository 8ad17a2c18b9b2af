"""engine="auto"'s choice of mover per transfer (pure: no disk)."""

from __future__ import annotations

import pytest

from deepnvme.io.choice import (
    PREFERENCES,
    SMALL_BYTES,
    TransferShape,
    auto_choices,
    choose,
    classify,
)

ENGINE_SPECIFIC = True  # pure: not re-run per engine
BOTH = ("io_uring", "aio")


def shape(*, write=False, direct=True, extending=False, largest=1 << 20, workers=1, reused=False):
    return TransferShape(write=write, direct=direct, extending=extending, largest=largest,
                         workers=workers, reused=reused)


@pytest.mark.parametrize(("s", "transfer", "mover"), [
    (shape(direct=False), "buffered", "io_uring"),
    (shape(write=True, direct=False, extending=True), "buffered", "io_uring"),
    (shape(write=True, extending=True), "file-extending write, 1 worker", "io_uring"),
    (shape(write=True, extending=True, largest=4096), "file-extending write, 1 worker", "io_uring"),
    (shape(write=True, extending=True, workers=2), "file-extending write, 2+ workers", "aio"),
    (shape(write=True, direct=False, extending=True, workers=4), "buffered", "io_uring"),
    (shape(largest=4096), "small direct reads", "io_uring"),
    (shape(write=True, largest=SMALL_BYTES - 1), "small direct writes", "aio"),
    (shape(largest=SMALL_BYTES), "large direct read", "aio"),
    (shape(write=True), "large direct overwrite", "aio"),
    (shape(extending=True), "large direct read", "aio"),  # a read never extends
    (shape(reused=True), "large direct read, reused locked buffer", "io_uring"),
    (shape(write=True, reused=True), "large direct overwrite, reused locked buffer", "io_uring"),
    (shape(reused=True, largest=4096), "small direct reads", "io_uring"),
    (shape(write=True, reused=True, extending=True, workers=2), "file-extending write, 2+ workers", "aio"),
    (shape(reused=True, direct=False), "buffered", "io_uring"),
])
def test_each_class_and_its_mover(s, transfer, mover):
    assert classify(s) == transfer
    got = choose(s, BOTH)
    assert (got.transfer, got.mover) == (transfer, mover) and got.why


def test_an_unavailable_mover_falls_to_the_next_and_says_so():
    got = choose(shape(write=True, extending=True), ("aio",))
    assert got.mover == "aio" and "io_uring unavailable" in got.why
    got = choose(shape(), ("io_uring",))
    assert got.mover == "io_uring" and "Linux AIO unavailable" in got.why
    got = choose(shape(reused=True), ("aio",))
    assert got.mover == "aio" and "io_uring unavailable" in got.why
    with pytest.raises(ValueError, match="threads"):
        choose(shape(), ("threads",))


def test_auto_choices_cover_every_class_once():
    table = auto_choices(BOTH + ("threads",))
    assert [c.transfer for c in table] == list(PREFERENCES)
    assert {c.mover for c in table} == set(BOTH)
    assert {c.mover for c in auto_choices(("aio", "threads"))} == {"aio"}
    assert auto_choices(("threads",)) == ()
    without = auto_choices(BOTH, registers=False)
    assert [c.transfer for c in without] == [t for t in PREFERENCES if "reused" not in t]
