"""deepnvme.save / deepnvme.load against plain torch.save / torch.load, faults, atomicity."""

from __future__ import annotations

import errno
import os
import pickle

import pytest
import torch

import deepnvme
from deepnvme.errors import CheckpointFormatError
from deepnvme.io.posix import Posix, injected


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(300, 257, generator=g)
    return {
        "f32": base,
        "view": base[10:20, 3:9],                      # shares base's storage
        "t": base.t(),                                 # non-contiguous, same storage
        "bf16": torch.randn(33, 65, generator=g).bfloat16(),
        "f16": torch.randn(1000, generator=g).half(),
        "f64": torch.randn(17, generator=g).double(),
        "i8": torch.randint(-128, 127, (4099,), dtype=torch.int8, generator=g),
        "i64": torch.arange(12345),
        "bool": torch.rand(77, generator=g) > 0.5,
        "u8": torch.randint(0, 255, (70000,), dtype=torch.uint8, generator=g),
        "empty": torch.zeros(0, 5),
        "scalar": torch.tensor(3.5),
        "param": torch.nn.Parameter(torch.ones(4, 4)),
        "nested": {"list": [1, 2.5, "x", (3, None)], "tuple": (torch.ones(3), True), "s": "str"},
        "step": 17,
    }


def _equal(a, b) -> None:
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
        assert type(a) is type(b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _equal(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("mmap", [False, True])
def test_torch_load_reads_deepnvme_save(tmp_path, mmap):
    state = _state()
    path = tmp_path / "ck.pt"
    deepnvme.save(state, path)
    back = torch.load(path, weights_only=True, mmap=mmap)
    _equal(state, back)
    assert back["view"].untyped_storage().data_ptr() == back["f32"].untyped_storage().data_ptr()
    assert back["t"].untyped_storage().data_ptr() == back["f32"].untyped_storage().data_ptr()
    assert os.listdir(tmp_path) == ["ck.pt"]


@pytest.mark.parametrize("writer", ["torch", "deepnvme"])
def test_deepnvme_load_equals_torch_load(tmp_path, writer):
    state = _state()
    path = str(tmp_path / "ck.pt")
    (torch.save if writer == "torch" else deepnvme.save)(state, path)
    back = deepnvme.load(path)
    _equal(torch.load(path, weights_only=True), back)
    _equal(state, back)
    assert back["view"].untyped_storage().data_ptr() == back["f32"].untyped_storage().data_ptr()


def test_many_small_tensors_batched_between_large_ones(tmp_path):
    g = torch.Generator().manual_seed(3)
    state = {}
    for i in range(120):
        n = [0, 1, 7, 1000, 30_000, 70_000][i % 6]
        state[f"s{i}"] = torch.randn(n, generator=g)
        if i % 40 == 0:
            state[f"big{i}"] = torch.randn(100_000, generator=g)
    path = str(tmp_path / "small.pt")
    deepnvme.save(state, path)
    _equal(state, torch.load(path, weights_only=True))
    _equal(state, deepnvme.load(path))
    torch.save(state, path)  # torch's 64-byte alignment: small records sit back to back
    _equal(state, deepnvme.load(path))


def test_load_map_location_and_legacy_format(tmp_path):
    path = str(tmp_path / "legacy.pt")
    torch.save({"a": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(deepnvme.load(path, map_location="cpu")["a"], torch.ones(3))
    path2 = str(tmp_path / "new.pt")
    deepnvme.save({"a": torch.ones(3)}, path2)
    out = deepnvme.load(path2, map_location=lambda storage, loc: storage)
    assert torch.equal(out["a"], torch.ones(3))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo should-not-run",))


def test_weights_only_refuses_code(tmp_path):
    path = str(tmp_path / "evil.pt")
    torch.save({"x": _Evil(), "t": torch.ones(2)}, path)
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        deepnvme.load(path)


def test_weights_only_false_loads_arbitrary_objects(tmp_path):
    path = str(tmp_path / "obj.pt")
    deepnvme.save({"c": complex(1, 2), "od": {"a": torch.ones(2)}}, path)
    assert deepnvme.load(path, weights_only=False)["c"] == complex(1, 2)


def test_truncated_and_corrupted_files_raise(tmp_path):
    path = str(tmp_path / "ck.pt")
    deepnvme.save({"a": torch.randn(100_000)}, path)
    raw = open(path, "rb").read()
    for cut in (len(raw) - 100, len(raw) // 2, 3000, 0):
        bad = str(tmp_path / f"cut{cut}.pt")
        open(bad, "wb").write(raw[:cut])
        with pytest.raises((CheckpointFormatError, OSError)):
            deepnvme.load(bad)
    garbled = bytearray(raw)
    garbled[-200:-100] = b"\xff" * 100  # central directory damaged
    bad = str(tmp_path / "garbled.pt")
    open(bad, "wb").write(bytes(garbled))
    with pytest.raises((CheckpointFormatError, RuntimeError)):
        deepnvme.load(bad)


def test_missing_directory_and_file(tmp_path):
    with pytest.raises(OSError) as info:
        deepnvme.save({"a": torch.ones(1)}, tmp_path / "nope" / "ck.pt")
    assert info.value.errno == errno.ENOENT and "does not exist" in str(info.value)
    with pytest.raises(FileNotFoundError):
        deepnvme.load(tmp_path / "missing.pt")


class _Failing(Posix):
    def __init__(self, err: int, on: str) -> None:
        self.err, self.on = err, on

    def open(self, path, *, write, direct, **kw):
        if self.on == "open" and write:
            raise deepnvme.DeepNVMeIOError.from_oserror(OSError(self.err, os.strerror(self.err)),
                                                       op="open", path=path, offset=None, size=None)
        return super().open(path, write=write, direct=direct, **kw)

    def fallocate(self, fd, offset, length):
        if self.on == "fallocate":
            raise OSError(self.err, os.strerror(self.err))
        return super().fallocate(fd, offset, length)

    def pwritev(self, fd, buffers, offset):
        if self.on == "write":
            raise OSError(self.err, os.strerror(self.err))
        return super().pwritev(fd, buffers, offset)


@pytest.mark.parametrize("err,on", [(errno.ENOSPC, "write"), (errno.ENOSPC, "fallocate"),
                                    (errno.EACCES, "open"), (errno.EIO, "write")])
def test_failed_save_keeps_previous_checkpoint(tmp_path, err, on):
    path = str(tmp_path / "ck.pt")
    old = {"a": torch.arange(50_000)}
    deepnvme.save(old, path)
    with pytest.raises(OSError) as info:
        with injected(_Failing(err, on)):
            deepnvme.save({"a": torch.zeros(50_000, dtype=torch.int64)}, path)
    assert info.value.errno == err
    assert "ck.pt" in str(info.value)
    assert os.listdir(tmp_path) == ["ck.pt"]  # no temporary file left
    assert torch.equal(torch.load(path, weights_only=True)["a"], old["a"])


def test_save_replaces_atomically_and_is_idempotent(tmp_path):
    path = str(tmp_path / "ck.pt")
    for i in range(3):
        deepnvme.save({"i": torch.full((1000,), i)}, path)
        assert torch.equal(deepnvme.load(path)["i"], torch.full((1000,), i))
    assert os.listdir(tmp_path) == ["ck.pt"]


def test_zip64_offsets_beyond_4gib(tmp_path):
    """A >4 GiB checkpoint: records past 4 GiB are found and filled (sparse file, lazy memory)."""
    from deepnvme.checkpoint.saver import write_skeleton, write_storages
    from deepnvme.config import checkpoint_config

    big = torch.empty((5 << 30) + 3, dtype=torch.uint8)  # never touched: no memory committed
    tail = torch.arange(1000, dtype=torch.float32)
    path = str(tmp_path / "big.pt")
    layout = write_skeleton({"big": big, "tail": tail}, path)
    spans = {st.nbytes(): span for st, span in layout.items.values()}
    assert spans[4000].offset > (5 << 30) and spans[4000].offset % 4096 == 0
    with deepnvme.AioHandle(config=checkpoint_config(None)) as h:
        key = next(k for k, (st, _) in layout.items.items() if st.nbytes() == 4000)
        write_storages(h, path, layout, [key])
    back = torch.load(path, weights_only=True, mmap=True)
    assert torch.equal(back["tail"], tail) and back["big"].numel() == big.numel()


def test_clean_temp_files(tmp_path):
    dead = tmp_path / ".ck.pt.deepnvme-tmp-999999999-abcd1234"
    alive = tmp_path / f".ck.pt.deepnvme-tmp-{os.getpid()}-abcd1234"
    other = tmp_path / "keep.pt"
    for p in (dead, alive, other):
        p.write_bytes(b"x")
    assert deepnvme.clean_temp_files(str(tmp_path)) == [str(dead)]
    assert sorted(os.listdir(tmp_path)) == sorted([alive.name, other.name])


def test_load_falls_back_to_torch_load_without_torch_internals(tmp_path, monkeypatch, caplog):
    import sys
    load_mod = sys.modules["deepnvme.checkpoint.loader"]  # the package attribute is the function
    state = {"w": torch.randn(100, 10), "n": 3}
    deepnvme.save(state, tmp_path / "ck.pt")
    assert load_mod._torch_internals_available()  # this torch has them all
    # a future torch without one of the private pieces (removing a real one breaks torch.load)
    monkeypatch.setattr(load_mod, "_INTERNALS",
                        load_mod._INTERNALS + (("torch.serialization", "_gone_in_a_future_torch"),))
    monkeypatch.setattr(load_mod, "_warned_internals", False)
    called = []
    real_torch_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: called.append(k) or real_torch_load(*a, **k))
    back = deepnvme.load(tmp_path / "ck.pt")
    assert torch.equal(back["w"], state["w"]) and back["n"] == 3
    assert called and called[0]["weights_only"] is True
    assert "torch.serialization._gone_in_a_future_torch" in caplog.text
