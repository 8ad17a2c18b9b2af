"""The vLLM loader's weight stream against the safetensors package, on real files (no vLLM needed)."""

import json
import os

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from deepnvme.errors import CheckpointFormatError, DeepNVMeError  # noqa: E402
from deepnvme.integrations import _weights  # noqa: E402
from deepnvme.integrations._weights import loader_options, stream_weights  # noqa: E402


def _sharded(folder, shards):
    """Write ``shards`` ({file name: {tensor name: tensor}}) and their index into ``folder``."""
    weight_map = {}
    for file, tensors in shards.items():
        safetensors_torch.save_file(tensors, os.path.join(folder, file))
        weight_map.update({name: file for name in tensors})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.fixture
def folder(tmp_path):
    g = torch.Generator().manual_seed(0)
    shards = {
        "model-00001-of-00002.safetensors": {
            "odd.bf16": torch.randn(3, generator=g).to(torch.bfloat16),   # leaves the next tensor misaligned
            "big": torch.randn(300, 700, generator=g),
            "ints": torch.arange(17, dtype=torch.int64),
            "empty": torch.empty(0, 4),
        },
        "model-00002-of-00002.safetensors": {
            "w.f16": torch.randn(64, 33, generator=g).to(torch.float16),
            "scalar": torch.tensor(2.5),
            "u8": torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g),
        },
    }
    _sharded(tmp_path, shards)
    with open(tmp_path / "stray.safetensors", "wb") as f:   # not in the index: must be ignored
        f.write(b"not a safetensors file")
    return tmp_path


@pytest.mark.parametrize("window", ["64K", "1", "64M"])
def test_stream_equals_the_safetensors_package(folder, window):
    expected = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("model-"):
            expected.update(safetensors_torch.load_file(str(folder / name)))
    got = dict(stream_weights(str(folder), loader_options({"read_window": window, "engine": "threads"})))
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), name


def test_single_file_and_default_engine(tmp_path):
    tensors = {"a": torch.randn(1000, 300), "b": torch.ones(7, dtype=torch.int32)}
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    got = dict(stream_weights(str(tmp_path), loader_options({"read_window": "256K"})))
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())


def test_the_next_range_and_no_more_is_read_ahead(folder, monkeypatch):
    """When the consumer gets range k's tensors, range k + 1 is already being read (the read
    overlaps the consumer's copies) and no range after it is: at most two ranges are held."""
    allocated = []
    real = _weights._Windows.take

    def counting(self, nbytes, offset):
        allocated.append(nbytes)
        return real(self, nbytes, offset)

    monkeypatch.setattr(_weights._Windows, "take", counting)
    options = loader_options({"read_window": 4096, "engine": "threads"})
    tensors = _weights.checkpoint_tensors(str(folder))
    ranges = _weights.plan_ranges(tensors, 4096)
    assert len(ranges) >= 4
    range_of = {t.name: i for i, r in enumerate(ranges) for t in r.tensors}
    for name, _ in stream_weights(str(folder), options):
        assert len(allocated) == min(range_of[name] + 2, len(ranges)), name
    assert len(allocated) == len(ranges)
    # each read is at most one window, or one tensor larger than it: never a whole shard
    assert max(allocated) == max(4096, max(t.nbytes for t in tensors))


def test_not_a_local_folder():
    with pytest.raises(DeepNVMeError, match="local model folder.*meta-llama/Llama-3.1-8B"):
        next(stream_weights("meta-llama/Llama-3.1-8B", loader_options({})))


def test_folder_without_safetensors(tmp_path):
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointFormatError, match=r"model.safetensors.*any \*.safetensors file"):
        next(stream_weights(str(tmp_path), loader_options({})))


def test_without_an_index_every_safetensors_file_is_read_as_vllm_does(folder):
    """No ``model.safetensors`` and no index (``consolidated.safetensors``, loose shards): every
    ``*.safetensors`` file of the folder, as vLLM's default loader takes them."""
    os.remove(folder / "model.safetensors.index.json")
    os.remove(folder / "stray.safetensors")
    expected = {}
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        expected.update(safetensors_torch.load_file(str(folder / name)))
    got = dict(stream_weights(str(folder), loader_options({})))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_index_naming_a_missing_shard(folder):
    os.remove(folder / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointFormatError, match="model-00002-of-00002.safetensors"):
        next(stream_weights(str(folder), loader_options({})))


def test_truncated_shard_is_an_error_not_a_short_tensor(folder):
    path = folder / "model-00001-of-00002.safetensors"
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(CheckpointFormatError, match="model-00001-of-00002"):
        list(stream_weights(str(folder), loader_options({})))


def test_closing_early_stops_the_engine_threads(folder):
    import threading
    before = threading.active_count()
    stream = stream_weights(str(folder), loader_options({"read_window": 4096, "engine": "threads",
                                                         "intra_op_parallelism": 3}))
    next(stream)
    assert threading.active_count() > before
    stream.close()
    assert threading.active_count() == before


def _many(tmp_path, n=24):
    g = torch.Generator().manual_seed(1)
    tensors = {f"t{i:02d}": torch.randn(4096, generator=g) for i in range(n)}   # 16 KiB each
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    return tensors


def test_buffers_are_reused_once_the_consumer_lets_go(tmp_path):
    expected = _many(tmp_path)
    made = []
    real = _weights._Windows.take

    def counting(self, nbytes, offset):
        out = real(self, nbytes, offset)
        made.append(self.made)
        return out

    got = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_weights._Windows, "take", counting)
        for name, t in stream_weights(str(tmp_path), loader_options({"read_window": "32K"})):
            got[name] = t.clone()   # copied, as a model's load_weights does, and dropped
            del t
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(got[name], t), name
    assert len(made) == 12 and made[-1] == 2   # 12 ranges read through two buffers


def test_windows_hand_out_a_buffer_only_when_nothing_views_it():
    w = _weights._Windows(1 << 16, 4096)
    a = w.take(1000, 100)
    assert a.data_ptr() % 4096 == 100 and a.numel() == 1000
    view = a[8:16]
    del a
    b = w.take(1000, 0)   # the first buffer is still viewed: a second one
    assert w.made == 2 and b.data_ptr() % 4096 == 0
    del view, b
    for _ in range(5):
        w.take(1 << 16, 0)   # each dropped at once: reused
    assert w.made == 2
    big = w.take(1 << 20, 0)   # larger than the buffers: a new one
    assert w.made == 3 and big.numel() == 1 << 20


def test_a_buffer_the_consumer_still_views_is_not_reused(tmp_path):
    expected = _many(tmp_path)
    kept = dict(stream_weights(str(tmp_path), loader_options({"read_window": "32K"})))
    assert len({t.untyped_storage().data_ptr() for t in kept.values()}) == 12
    for name, t in expected.items():   # nothing yielded was overwritten by a later read
        assert torch.equal(kept[name], t), name
