"""deepnvme.load_into against Module.load_state_dict(torch.load(...)): files, folders, faults."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch as st
import torch

import deepnvme
from deepnvme.checkpoint import inplace
from deepnvme.checkpoint._fill_plan import plan_fill as inplace_plan_fill
from deepnvme.errors import CheckpointFormatError, CheckpointMismatchError
from deepnvme.io.posix import Posix, injected


class Net(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(97, 48)
        self.proj = torch.nn.Linear(48, 300)
        self.norm = torch.nn.BatchNorm1d(300)
        self.head = torch.nn.Linear(48, 97, bias=False)
        self.register_buffer("scratch", torch.zeros(5), persistent=False)
        self.to(dtype)


def _trained(seed: int = 0, dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(seed)
    net = Net(dtype)
    with torch.no_grad():
        net.norm.running_mean.normal_()
        net.norm.running_var.uniform_(0.5, 2)
        net.norm.num_batches_tracked.fill_(123)
    return net


def _snapshot(target: torch.nn.Module | dict) -> dict[str, bytes]:
    sd = target.state_dict() if isinstance(target, torch.nn.Module) else target
    return {k: bytes(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()) for k, v in sd.items()}


def _reference(path: str, fresh: torch.nn.Module) -> dict[str, bytes]:
    fresh.load_state_dict(torch.load(path, weights_only=True) if not path.endswith(".safetensors")
                          else st.load_file(path))
    return _snapshot(fresh)


def _shard(sd: dict[str, torch.Tensor], folder: str, kind: str, max_bytes: int) -> int:
    """Write ``sd`` as transformers does: shards in order, each up to ``max_bytes``, and an index."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in sd.items():
        if groups[-1] and size + t.nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += t.nbytes
    ext, stem = ("safetensors", "model") if kind == "safetensors" else ("bin", "pytorch_model")
    weight_map = {}
    for i, group in enumerate(groups, 1):
        file = f"{stem}-{i:05d}-of-{len(groups):05d}.{ext}"
        if kind == "safetensors":
            st.save_file({k: v.contiguous() for k, v in group.items()}, os.path.join(folder, file))
        else:
            torch.save(group, os.path.join(folder, file))
        weight_map.update(dict.fromkeys(group, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in sd.values())}, "weight_map": weight_map}
    with open(os.path.join(folder, f"{stem}.{ext}.index.json"), "w") as f:
        json.dump(index, f)
    return len(groups)


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_module_from_file_matches_load_state_dict(tmp_path, kind):
    src = _trained()
    path = str(tmp_path / ("m.safetensors" if kind == "safetensors" else "m.pt"))
    (st.save_file if kind == "safetensors" else torch.save)(src.state_dict(), path)
    target = _trained(seed=1)
    ptrs = {k: v.data_ptr() for k, v in target.state_dict().items()}
    assert deepnvme.load_into(target, path) == ([], [])
    assert _snapshot(target) == _reference(path, _trained(seed=2)) == _snapshot(src)
    assert {k: v.data_ptr() for k, v in target.state_dict().items()} == ptrs   # in place


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_dict_target_same_dtype_goes_direct(tmp_path, kind, monkeypatch):
    g = torch.Generator().manual_seed(3)
    sd = {"a": torch.randn(1000, 33, generator=g), "b": torch.arange(7), "s": torch.tensor(2.5),
          "e": torch.zeros(0, 4), "h": torch.randn(5000, generator=g).half()}
    path = str(tmp_path / ("m.safetensors" if kind == "safetensors" else "m.pt"))
    (st.save_file if kind == "safetensors" else torch.save)(sd, path)
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    monkeypatch.setattr(inplace, "_bounce", lambda *a: pytest.fail("same dtype must not bounce"))
    monkeypatch.setattr(inplace, "BOUNCE_SLOTS", 0)
    result = deepnvme.load_into(target, path)
    assert isinstance(result, deepnvme.LoadResult) and result.missing_keys == [] and result.unexpected_keys == []
    assert all(torch.equal(target[k], sd[k]) for k in sd)


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
@pytest.mark.parametrize("file_dtype, model_dtype", [(torch.bfloat16, torch.float32),
                                                     (torch.float32, torch.float16)])
def test_dtype_conversion_as_copy(tmp_path, kind, file_dtype, model_dtype, monkeypatch):
    src = _trained(dtype=file_dtype)
    path = str(tmp_path / ("m.safetensors" if kind == "safetensors" else "m.pt"))
    (st.save_file if kind == "safetensors" else torch.save)(src.state_dict(), path)
    monkeypatch.setattr(inplace, "BOUNCE_CHUNK", 1000)      # many chunks, several rows each
    target = _trained(seed=1, dtype=model_dtype)
    deepnvme.load_into(target, path)
    assert _snapshot(target) == _reference(path, _trained(seed=2, dtype=model_dtype))


def test_non_contiguous_targets_and_stored_views(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(4)
    base = torch.randn(64, 40, generator=g)
    sd = {"t": base.t(), "v": base[3:9, 5:30], "x": torch.randn(30, 20, generator=g)}
    torch.save(sd, tmp_path / "m.pt")
    st.save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "m.safetensors")
    monkeypatch.setattr(inplace, "BOUNCE_CHUNK", 64)
    for file in ("m.pt", "m.safetensors"):
        holder = torch.zeros(20, 60)
        target = {"t": torch.zeros(80, 40).t()[:, :64].t().t(), "v": torch.zeros(25, 6).t(),
                  "x": holder[:, :30].t()}
        assert not target["x"].is_contiguous() and not target["v"].is_contiguous()
        deepnvme.load_into(target, str(tmp_path / file))
        assert all(torch.equal(target[k], sd[k]) for k in sd), file
        assert torch.equal(holder[:, 30:], torch.zeros(20, 30))   # nothing outside the view


def test_tied_weights_saved_by_save_model(tmp_path):
    src = _trained()
    src.head.weight = src.embed.weight
    st.save_model(src, str(tmp_path / "m.safetensors"))
    stored = st.load_file(str(tmp_path / "m.safetensors"))
    assert ("head.weight" in stored) != ("embed.weight" in stored)   # one name dropped
    target = _trained(seed=1)
    target.head.weight = target.embed.weight
    assert deepnvme.load_into(target, str(tmp_path / "m.safetensors")) == ([], [])
    assert _snapshot(target) == _snapshot(src)
    untied = _trained(seed=1)                                        # not tied: really missing
    with pytest.raises(CheckpointMismatchError) as info:
        deepnvme.load_into(untied, str(tmp_path / "m.safetensors"))
    assert len(info.value.missing_keys) == 1


def test_tied_weights_saved_by_torch_save_are_filled_once(tmp_path, monkeypatch):
    src = _trained()
    src.head.weight = src.embed.weight
    torch.save(src.state_dict(), tmp_path / "m.pt")                  # both names, one storage
    plans = []
    monkeypatch.setattr(inplace, "plan_fill", lambda *a: plans.append(inplace_plan_fill(*a)) or plans[-1])
    target = _trained(seed=1)
    target.head.weight = target.embed.weight
    assert deepnvme.load_into(target, tmp_path / "m.pt") == ([], [])
    assert _snapshot(target) == _snapshot(src)
    tied = [f for f in plans[0].fills if {f.name, *f.tied} == {"embed.weight", "head.weight"}]
    assert len(tied) == 1 and len(plans[0].fills) == len(target.state_dict()) - 1   # one transfer
    untied = _trained(seed=1)                                          # both filled, separately
    assert deepnvme.load_into(untied, tmp_path / "m.pt") == ([], [])
    assert torch.equal(untied.head.weight, src.embed.weight) and torch.equal(untied.embed.weight, src.embed.weight)


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_sharded_folders_with_index(tmp_path, kind):
    src = _trained()
    assert _shard(src.state_dict(), str(tmp_path), kind, 40_000) >= 3
    (tmp_path / "stray.safetensors").write_bytes(b"not read: the index does not name it")
    (tmp_path / "stray.bin").write_bytes(b"not read either")
    target = _trained(seed=1)
    assert deepnvme.load_into(target, str(tmp_path)) == ([], [])
    assert _snapshot(target) == _snapshot(src)


@pytest.mark.parametrize("single", ["model.safetensors", "pytorch_model.bin"])
def test_single_file_folders(tmp_path, single):
    src = _trained()
    (st.save_file if single.endswith("safetensors") else torch.save)(src.state_dict(), str(tmp_path / single))
    target = _trained(seed=1)
    deepnvme.load_into(target, tmp_path)
    assert _snapshot(target) == _snapshot(src)


def test_transformers_save_pretrained_shards(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64)
    torch.manual_seed(0)
    src = transformers.GPT2LMHeadModel(config)
    src.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    torch.manual_seed(1)
    target = transformers.GPT2LMHeadModel(config)
    assert target.lm_head.weight.data_ptr() == target.transformer.wte.weight.data_ptr()
    assert deepnvme.load_into(target, tmp_path) == ([], [])     # strict: the tied lm_head is not missing
    assert _snapshot(target) == _snapshot(src)


def test_strict_error_lists_everything_and_changes_nothing(tmp_path):
    sd = _trained().state_dict()
    sd["extra.weight"] = torch.ones(3)
    sd["norm.weight"] = torch.ones(7)                                   # shape mismatch
    del sd["proj.bias"]
    for kind in ("safetensors", "torch"):                                # sharded folders too
        (tmp_path / kind).mkdir()
        assert _shard(sd, str(tmp_path / kind), kind, 40_000) >= 3
    for file, save in (("m.safetensors", st.save_file), ("m.pt", torch.save), ("safetensors", None),
                       ("torch", None)):
        if save is not None:
            save(sd, str(tmp_path / file))
        target = _trained(seed=1)
        before = _snapshot(target)
        with pytest.raises(CheckpointMismatchError) as info:
            deepnvme.load_into(target, str(tmp_path / file))
        err = info.value
        assert isinstance(err, ValueError)
        assert err.missing_keys == ["proj.bias"] and err.unexpected_keys == ["extra.weight"]
        assert err.mismatched == [("norm.weight", (7,), (300,))]
        assert _snapshot(target) == before
        with pytest.raises(CheckpointMismatchError) as info:                # torch: still refused
            deepnvme.load_into(target, str(tmp_path / file), strict=False)
        assert "norm.weight" in str(info.value) and "proj.bias" not in str(info.value)
        assert _snapshot(target) == before


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no float4_e2m1fn_x2")
def test_dtype_copy_cannot_convert_is_refused_before_any_change(tmp_path):
    packed = torch.randint(0, 256, (6, 4), dtype=torch.uint8)
    sd = {"a": torch.arange(10.0), "q": packed.view(torch.float4_e2m1fn_x2)}
    st.save_file(sd, str(tmp_path / "m.safetensors"))
    target = {"a": torch.zeros(10), "q": torch.zeros(6, 4, dtype=torch.uint8)}   # a: direct, q: copy_ fails
    with pytest.raises(RuntimeError):
        target["q"].copy_(sd["q"])                                       # what a plain copy_ does
    with pytest.raises(CheckpointMismatchError, match="cannot convert.*float4_e2m1fn_x2") as info:
        deepnvme.load_into(target, tmp_path / "m.safetensors", strict=False)
    assert info.value.unconvertible == [("q", "torch.float4_e2m1fn_x2", "torch.uint8")]
    assert not target["a"].any() and not target["q"].any()             # nothing written, not even 'a'
    same = {"a": torch.zeros(10), "q": torch.zeros(6, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}
    deepnvme.load_into(same, tmp_path / "m.safetensors")                # same dtype: read as is
    assert torch.equal(same["q"].view(torch.uint8), packed) and torch.equal(same["a"], sd["a"])


def test_strict_false_returns_the_keys_like_torch(tmp_path):
    sd = _trained().state_dict()
    sd["extra.weight"] = torch.ones(3)
    del sd["proj.bias"]
    torch.save(sd, tmp_path / "m.pt")
    target, reference = _trained(seed=1), _trained(seed=1)
    result = deepnvme.load_into(target, tmp_path / "m.pt", strict=False)
    expected = reference.load_state_dict(torch.load(tmp_path / "m.pt"), strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (expected.missing_keys, expected.unexpected_keys)
    assert _snapshot(target) == _snapshot(reference)


def _malformed(tmp_path, src) -> list[tuple[str, str]]:
    sd = src.state_dict()
    out = []
    st.save_file(sd, str(tmp_path / "ok.safetensors"))
    raw = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-10])
    out.append((str(tmp_path / "cut.safetensors"), "truncated"))
    torch.save(sd, tmp_path / "ok.pt")
    raw = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) // 2])
    out.append((str(tmp_path / "cut.pt"), "cut.pt"))
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps({"a": 1}))
    out.append((str(tmp_path / "legacy.pt"), "not a torch.save zip"))
    torch.save({"model": sd, "step": 3}, tmp_path / "nested.pt")
    out.append((str(tmp_path / "nested.pt"), "'model'"))
    torch.save({"a": torch.nn.ReLU()}, tmp_path / "unsafe.pt")
    out.append((str(tmp_path / "unsafe.pt"), "weights_only"))
    bad = tmp_path / "bad_index"
    bad.mkdir()
    _shard(sd, str(bad), "safetensors", 40_000)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["proj.bias"] = "model-00001-of-00009.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    out.append((str(bad), "model-00001-of-00009"))
    wrong = tmp_path / "wrong_shard"
    wrong.mkdir()
    _shard(sd, str(wrong), "torch", 40_000)
    index = json.loads((wrong / "pytorch_model.bin.index.json").read_text())
    index["weight_map"]["embed.weight"] = index["weight_map"]["head.weight"]
    (wrong / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    out.append((str(wrong), "puts 'embed.weight'"))
    empty = tmp_path / "empty_folder"
    empty.mkdir()
    out.append((str(empty), "holds no checkpoint"))
    return out


def test_malformed_files_raise_format_error_before_any_change(tmp_path):
    src = _trained()
    for path, words in _malformed(tmp_path, src):
        target = _trained(seed=1)
        before = _snapshot(target)
        with pytest.raises(CheckpointFormatError) as info:
            deepnvme.load_into(target, path, strict=False)
        assert words in str(info.value), (path, str(info.value))
        assert _snapshot(target) == before, path
        unfit = {"proj.weight": torch.zeros(3), "not.in.file": torch.zeros(2)}   # would mismatch too
        with pytest.raises(CheckpointFormatError):
            deepnvme.load_into(unfit, path)                             # the file's fault comes first
        assert not unfit["proj.weight"].any(), path


def test_bad_targets_are_refused(tmp_path):
    torch.save({"a": torch.ones(2)}, tmp_path / "m.pt")
    with pytest.raises(TypeError, match="target entry 'a'"):
        deepnvme.load_into({"a": [1, 2]}, tmp_path / "m.pt")
    with pytest.raises(deepnvme.UnsupportedBufferError, match="meta"):
        deepnvme.load_into({"a": torch.empty(2, device="meta")}, tmp_path / "m.pt")
    with pytest.raises(TypeError, match="nn.Module or a dict"):
        deepnvme.load_into([torch.ones(2)], tmp_path / "m.pt")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        deepnvme.load_into({"a": torch.ones(2)}, tmp_path / "nope.pt")


class _FailingReads(Posix):
    def preadv(self, fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])     # direct, bounce
def test_read_error_names_the_file(tmp_path, dtype):
    st.save_file({"a": torch.ones(100_000)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(OSError) as info, injected(_FailingReads()):
        deepnvme.load_into({"a": torch.zeros(100_000, dtype=dtype)}, tmp_path / "m.safetensors")
    assert info.value.errno == errno.EIO and "m.safetensors" in str(info.value)


def test_module_whose_state_dict_copies_is_refused(tmp_path):
    class Copying(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(2))
            self._register_state_dict_hook(lambda mod, sd, prefix, local: {k: v.clone() for k, v in sd.items()})

    torch.save({"a": torch.ones(2)}, tmp_path / "m.pt")
    with pytest.raises(deepnvme.UnsupportedBufferError, match="cannot be filled in place"):
        deepnvme.load_into(Copying(), tmp_path / "m.pt")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cuda_route", ["bounce", "staged"])
@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_cuda_targets(tmp_path, kind, cuda_route, monkeypatch):
    from deepnvme.checkpoint import _fill_plan
    monkeypatch.setattr(_fill_plan, "CUDA_ROUTE", cuda_route)
    src = _trained()
    path = str(tmp_path / ("m.safetensors" if kind == "safetensors" else "m.pt"))
    (st.save_file if kind == "safetensors" else torch.save)(src.state_dict(), path)
    target = _trained(seed=1).cuda()
    deepnvme.load_into(target, path)                      # the CUDA route
    assert _snapshot(target) == _snapshot(src)
    if kind == "safetensors":
        fresh = deepnvme.load_safetensors(path, device="cuda")
        assert all(t.is_cuda for t in fresh.values())
        assert {k: v.cpu() for k, v in fresh.items()}.keys() == src.state_dict().keys()
        assert all(torch.equal(fresh[k].cpu(), v) for k, v in src.state_dict().items())
    half = _trained(seed=1).cuda().half()
    deepnvme.load_into(half, path)                        # bounce + copy_ with conversion
    assert _snapshot(half) == _snapshot(src.half())


_RSS_SCRIPT = textwrap.dedent("""
    import sys, torch, deepnvme
    path, dtype, n = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3])
    target = {f"w{i}": torch.zeros(n, dtype=dtype) for i in range(8)}    # resident: zero-filled
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                  # peak RSS (VmHWM) := current RSS
    before = status("VmHWM:")
    deepnvme.load_into(target, path)
    peak = status("VmHWM:")
    assert all(bool((t == i + 1).all()) for i, t in enumerate(target.values()))
    print(before, peak)
""")



@pytest.mark.parametrize("kind, target_dtype", [("safetensors", "float32"), ("torch", "float32"),
                                                ("safetensors", "bfloat16")])
def test_peak_memory_stays_far_below_a_second_model(tmp_path, kind, target_dtype):
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs /proc/self/clear_refs to reset the peak RSS (Linux)")
    n = 6_250_000                                       # 8 tensors x 25 MB = 200 MB of float32
    sd = {f"w{i}": torch.full((n,), float(i + 1)) for i in range(8)}
    path = str(tmp_path / ("m.safetensors" if kind == "safetensors" else "m.pt"))
    (st.save_file if kind == "safetensors" else torch.save)(sd, path)
    del sd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(deepnvme.__path__[0]),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, path, target_dtype, str(n)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    start, peak = map(int, out.stdout.split())
    model_bytes = 8 * n * 4
    assert peak - start < model_bytes / 2, (peak - start, model_bytes)
