"""Striped files on a volume of tmp_path subdirectories: round trips at odd sizes and offsets,
layout mismatches refused, and part failures named with their drive."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest
import torch

import deepnvme
from deepnvme import ShortTransferError, Volume, VolumeLayoutError
from deepnvme.io.posix import Posix

from ...conftest import random_tensor, same_bytes
from ...fakes import FakeStagedHandle, FullDisk

STRIPE = 8192


@pytest.fixture
def vol(tmp_path):
    return Volume([tmp_path / "d0", tmp_path / "d1", tmp_path / "d2"], stripe=STRIPE)


@pytest.fixture
def h():
    handle = deepnvme.AioHandle(block_size=4096, queue_depth=8, intra_op_parallelism=2)
    yield handle
    handle.close()


@pytest.mark.parametrize("offset,nbytes", [(0, 1), (0, 3 * STRIPE), (STRIPE - 5, 2 * STRIPE + 11),
                                           (4096, 7 * STRIPE + 4096), (12345, 100_003)])
def test_round_trip_matches_a_plain_file(h, vol, tmp_path, offset, nbytes):
    t = random_tensor(nbytes, torch.uint8, seed=nbytes)
    plain = str(tmp_path / "plain.bin")
    assert h.sync_pwrite(t, vol / "x.bin", offset) == 1
    h.sync_pwrite(t, plain, offset)
    whole = torch.empty(offset + nbytes, dtype=torch.uint8)
    h.sync_pread(whole, vol / "x.bin")
    expect = torch.from_file(plain, size=offset + nbytes, dtype=torch.uint8)
    assert same_bytes(whole, expect)
    sizes = [os.path.getsize((vol / "x.bin").part(d)) for d in range(3)]
    assert sum(sizes) == offset + nbytes
    rec = json.loads(open((vol / "x.bin").record(2)).read())
    assert rec["size"] == offset + nbytes and rec["parts"] == sizes and rec["stripe"] == STRIPE


def test_futures_batches_and_async_calls(h, vol):
    tensors = [random_tensor(3000 + 977 * i, seed=i) for i in range(6)]
    offsets, pos = [], 100
    for t in tensors:
        offsets.append(pos)
        pos += t.nbytes + 333
    assert h.write_many(vol / "m.bin", list(zip(tensors, offsets)), fsync=True).result() \
        == sum(t.nbytes for t in tensors)
    backs = [torch.empty_like(t) for t in tensors]
    assert h.read_many(vol / "m.bin", list(zip(backs, offsets)), validate=True).result() \
        == sum(t.nbytes for t in tensors)
    assert all(same_bytes(a, b) for a, b in zip(backs, tensors))
    one = torch.empty_like(tensors[3])
    assert h.submit_read(one, vol / "m.bin", offset=offsets[3]).result() == one.nbytes
    assert same_bytes(one, tensors[3])
    assert h.async_pwrite(tensors[0], vol / "n.bin", 5) == 0 and h.wait() == 1
    assert h.pwrite(tensors[1], vol / "n.bin", True, False, 7) == 1  # validate, sync
    back = torch.empty_like(tensors[1])
    assert h.async_pread(back, vol / "n.bin", 7) == 0 and h.wait() == 1
    assert same_bytes(back, tensors[1])
    # DeepSpeed's read(): the buffer must hold the rest of the file from the offset
    whole = torch.empty(7 + tensors[1].nbytes, dtype=torch.uint8)
    assert h.read(whole, vol / "n.bin", False) == 0
    with pytest.raises(deepnvme.DeepNVMeIOError, match="file holds"):
        h.read(back, vol / "n.bin", False)
    # kept descriptors of the parts close through the striped path
    assert h.submit_read(back, vol / "n.bin", offset=7, keep_open=True).result() == back.nbytes
    h.close_files([vol / "n.bin"])


def test_staged_route_stripes_its_chunks(vol):
    with FakeStagedHandle(block_size=4096, queue_depth=8, intra_op_parallelism=2) as sh:
        t = random_tensor(70_001, seed=3)
        sh.sync_pwrite(t, vol / "s.bin", 999)
        back = torch.empty_like(t)
        sh.sync_pread(back, vol / "s.bin", 999)
    assert same_bytes(back, t)
    assert json.loads(open((vol / "s.bin").record(0)).read())["size"] == 999 + t.nbytes


def test_read_past_the_end_is_refused(h, vol):
    h.sync_pwrite(random_tensor(5000, torch.uint8), vol / "x.bin")
    with pytest.raises(ShortTransferError, match="has 5000 bytes"):
        h.sync_pread(torch.empty(100, dtype=torch.uint8), vol / "x.bin", 4950)


def test_layout_mismatches_are_errors_naming_the_drive(h, vol, tmp_path):
    t = random_tensor(50_000, torch.uint8)
    h.sync_pwrite(t, vol / "x.bin")
    back = torch.empty_like(t)
    d = [str(tmp_path / f"d{i}") for i in range(3)]
    with pytest.raises(VolumeLayoutError, match="stripe=8192.*stripe=16384"):
        h.sync_pread(back, Volume(d, stripe=16384) / "x.bin")
    with pytest.raises(VolumeLayoutError, match="another order"):
        h.sync_pread(back, Volume([d[1], d[0], d[2]], stripe=STRIPE) / "x.bin")
    with pytest.raises(VolumeLayoutError, match="written on drives"):
        h.sync_pread(back, Volume(d[:2], stripe=STRIPE) / "x.bin")
    with pytest.raises(VolumeLayoutError, match="written on drives"):  # and never overwritten
        h.sync_pwrite(back, Volume(d[:2], stripe=STRIPE) / "x.bin")
    os.rename(d[1], d[1] + "-gone")
    with pytest.raises(VolumeLayoutError, match="drive 1 .*does not exist") as info:
        h.sync_pread(back, vol / "x.bin")
    assert info.value.path == (vol / "x.bin").record(1) and info.value.errno == errno.ENOENT
    os.rename(d[1] + "-gone", d[1])
    os.unlink((vol / "x.bin").part(2))
    with pytest.raises(VolumeLayoutError, match="drive 2 .*part file is missing"):
        h.sync_pread(back, vol / "x.bin")
    with pytest.raises(VolumeLayoutError, match="drive 2"):  # a write does not paper over it
        h.sync_pwrite(back, vol / "x.bin")


def test_truncated_part_and_other_write_are_refused(h, vol):
    t = random_tensor(50_000, torch.uint8)
    h.sync_pwrite(t, vol / "x.bin")
    h.sync_pwrite(t, vol / "y.bin")
    os.truncate((vol / "x.bin").part(0), 100)
    with pytest.raises(VolumeLayoutError, match="drive 0: the part .* has 100 bytes"):
        h.sync_pread(torch.empty_like(t), vol / "x.bin")
    # drive 1's record and part of another file copied over this one's
    for suffix in ("part1", "volume.json"):
        src = (vol / "y.bin").record(1) if suffix == "volume.json" else (vol / "y.bin").part(1)
        dst = (vol / "x.bin").record(1) if suffix == "volume.json" else (vol / "x.bin").part(1)
        os.replace(src, dst)
    with pytest.raises(VolumeLayoutError, match="drive 1 holds the record of drive 1 of 'y.bin'"):
        h.sync_pread(torch.empty_like(t), vol / "x.bin")


class _ShortOn(Posix):
    """Reads of files whose name ends with ``suffix`` return fewer bytes, then end-of-file."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def preadv(self, fd, buffers, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(self.suffix):
            return 0
        return super().preadv(fd, buffers, offset)


def test_short_read_on_one_part_names_drive_part_and_offset(vol):
    t = random_tensor(100_000, torch.uint8)
    with deepnvme.AioHandle(block_size=4096, intra_op_parallelism=2) as ok:
        ok.sync_pwrite(t, vol / "x.bin")
    with deepnvme.AioHandle(block_size=4096, intra_op_parallelism=2, posix=_ShortOn(".part1")) as bad:
        with pytest.raises(ShortTransferError) as info:
            bad.sync_pread(torch.empty_like(t), vol / "x.bin")
    err = info.value
    assert err.path == (vol / "x.bin").part(1)
    notes = "\n".join(getattr(err, "__notes__", []))
    if hasattr(err, "add_note"):
        assert "volume drive 1 of 3" in notes and "logical offset" in notes


def test_write_failure_on_one_drive_is_reported(vol):
    disk = FullDisk()
    disk.full.add("x.bin.part2")
    with deepnvme.AioHandle(block_size=4096, posix=disk) as h:
        with pytest.raises(OSError) as info:
            h.sync_pwrite(random_tensor(100_000, torch.uint8), vol / "x.bin")
    assert info.value.errno == errno.ENOSPC
    assert getattr(info.value, "path", None) == (vol / "x.bin").part(2)


class _Rendezvous(Posix):
    """A read of part 0 waits until a read of part 1 has started: only drives served at
    the same time get past it (a hard timeout fails the test instead of hanging)."""

    def __init__(self) -> None:
        self.part1_started = threading.Event()
        self.overlapped = False

    def preadv(self, fd, buffers, offset):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.endswith(".part1"):
            self.part1_started.set()
        elif name.endswith(".part0") and self.part1_started.wait(timeout=10):
            self.overlapped = True
        return super().preadv(fd, buffers, offset)


def test_every_drive_is_busy_at_once(tmp_path):
    vol = Volume([tmp_path / "a", tmp_path / "b"], stripe=4096)
    t = random_tensor(64 * 4096, torch.uint8)
    posix = _Rendezvous()
    # one worker per engine: with a single shared worker part 0 would wait alone
    with deepnvme.AioHandle(block_size=4096, intra_op_parallelism=1, posix=posix) as h:
        h.sync_pwrite(t, vol / "x.bin")
        back = torch.empty_like(t)
        h.sync_pread(back, vol / "x.bin")
    assert same_bytes(back, t) and posix.overlapped
