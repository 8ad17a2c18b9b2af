"""``load_format="deepnvme_stream"`` inside vLLM: decoder layers streamed from an aligned copy,
greedy tokens equal to vLLM's in-memory ``safetensors`` load.

Needs the vLLM side environment (``tools/test_vllm.sh`` builds it and runs this file); skipped
where vLLM is not importable.
"""

import gc
import types

import pytest
import torch

from ...fakes import copy_named_weights, in_process_vllm, tiny_llama

vllm = in_process_vllm()
transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from deepnvme.errors import ConfigError, DeepNVMeError  # noqa: E402
from deepnvme.inference import stream_stats, streamer_of  # noqa: E402

PROMPTS = [[1, 5, 9, 17, 33], [200, 3, 3, 140, 7, 64, 2], [11, 12]]
LAYERS = 4


def _run(model_dir, load_format, dtype, **extra):
    """Greedy tokens and, for deepnvme_stream, the streamer's counters."""
    llm = vllm.LLM(model=model_dir, load_format=load_format, skip_tokenizer_init=True,
                   distributed_executor_backend="uni", enforce_eager=True, dtype=dtype,
                   max_model_len=128, seed=0, **extra)
    try:
        stats = None
        if load_format == "deepnvme_stream":
            llm.apply_model(lambda m: streamer_of(m).reset_stats())   # count generate() only
        params = vllm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if load_format == "deepnvme_stream":
            stats = llm.apply_model(stream_stats)[0], llm.apply_model(_held_by_streamed_layers)[0]
    finally:
        del llm
        gc.collect()
    return tokens, stats


def _held_by_streamed_layers(model):
    """Per streamed layer: (bytes its parameters' storages hold, number of parameters)."""
    return [(sum(p.untyped_storage().nbytes() for p, _ in b.bindings), len(b.bindings))
            for b in streamer_of(model).blocks]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_streamed_layers_give_the_in_memory_tokens(tmp_path, dtype, caplog):
    model_dir = tiny_llama(tmp_path / "llama", dtype, layers=LAYERS)
    name = str(dtype).removeprefix("torch.")
    layer_bytes = (128 * (128 + 2 * 64 + 128) + 3 * 128 * 256 + 2 * 128) * dtype.itemsize
    fixed = (2 * 256 * 128 + 128) * dtype.itemsize
    extra = {"packed_dir": str(tmp_path / "aligned"), "memory_budget": fixed + layer_bytes + 100,
             "prefetch": 1, "engine": "threads", "read_window": "64K"}
    with caplog.at_level("INFO", logger="deepnvme"):
        first, (stats, held) = _run(model_dir, "deepnvme_stream", name, model_loader_extra_config=extra)
    assert any("aligned copy written" in r.getMessage() and "3 layers" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    steps = 8   # one forward per step (prefill + 7 decodes), 3 streamed layers each
    assert stats.blocks_loaded >= 3 * steps and stats.bytes_read >= 3 * steps * layer_bytes
    # the budget held one layer: the 3 streamed ones keep no weights between forwards
    assert len(held) == 3 and all(nbytes <= count * dtype.itemsize for nbytes, count in held), held
    theirs, _ = _run(model_dir, "safetensors", name)
    assert first == theirs
    caplog.clear()
    with caplog.at_level("INFO", logger="deepnvme"):   # the aligned copy is reused
        again, _ = _run(model_dir, "deepnvme_stream", name, model_loader_extra_config=extra)
    assert again == theirs
    assert any("reusing the aligned layer copy" in r.getMessage() for r in caplog.records)


def _quantised_layers(model):
    return [len(b.quantized) for b in streamer_of(model).blocks]


def test_int8_streamed_layers_read_half_the_bytes(tmp_path):
    model_dir = tiny_llama(tmp_path / "llama", torch.bfloat16, layers=LAYERS)
    base = {"prefetch": 1, "engine": "threads", "read_window": "64K"}
    plain, (plain_stats, _) = _run(model_dir, "deepnvme_stream", "bfloat16",
                                   model_loader_extra_config={**base, "packed_dir": str(tmp_path / "p")})
    extra = {**base, "packed_dir": str(tmp_path / "q"), "quantize": "int8", "group_size": 64}
    llm = vllm.LLM(model=model_dir, load_format="deepnvme_stream", skip_tokenizer_init=True,
                   distributed_executor_backend="uni", enforce_eager=True, dtype="bfloat16",
                   max_model_len=128, seed=0, model_loader_extra_config=extra)
    try:
        # q/k/v fused into qkv_proj, gate/up into gate_up_proj, o_proj, down_proj: 4 per layer
        assert llm.apply_model(_quantised_layers)[0] == [4] * LAYERS
        llm.apply_model(lambda m: streamer_of(m).reset_stats())
        params = vllm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        stats = llm.apply_model(stream_stats)[0]
    finally:
        del llm
        gc.collect()
    assert stats.bytes_read < 0.65 * plain_stats.bytes_read
    same = sum(a == b for t, u in zip(tokens, plain) for a, b in zip(t, u))
    assert same >= 0.5 * sum(len(t) for t in plain), (tokens, plain)


@pytest.fixture(scope="module")
def loader_cls():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    loader = get_model_loader(LoadConfig(load_format="deepnvme_stream",
                                         model_loader_extra_config={"packed_dir": "/tmp/x"}))
    assert type(loader).__module__ == "deepnvme.integrations.vllm"
    return type(loader), LoadConfig


@pytest.mark.parametrize("extra, key", [
    ({}, "packed_dir"),
    ({"packed_dir": "/x", "memory_budget": "lots"}, "memory_budget"),
    ({"packed_dir": "/x", "prefetch": -1}, "prefetch"),
    ({"packed_dir": "/x", "queue_depth": 0}, "queue_depth"),
    ({"packed_dir": "/x", "budget": 1}, "budget"),
])
def test_extra_config_errors_name_the_key(loader_cls, extra, key):
    cls, load_config = loader_cls
    with pytest.raises(ConfigError, match=repr(key)):
        cls(load_config(load_format="deepnvme_stream", model_loader_extra_config=extra))


def test_a_post_processing_that_repacks_streamed_weights_is_refused(tmp_path, monkeypatch):
    """If vLLM's post-load step replaces a streamed layer's weight (a kernel-owned copy), the
    streamed bytes would be ignored: the loader must refuse rather than serve stale weights."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    def repack(self, layer):
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    monkeypatch.setattr(UnquantizedLinearMethod, "process_weights_after_loading", repack)
    model_dir = tiny_llama(tmp_path / "llama", torch.float32, layers=2)
    with pytest.raises(Exception, match="replaced streamed parameters"):
        vllm.LLM(model=model_dir, load_format="deepnvme_stream", skip_tokenizer_init=True,
                 distributed_executor_backend="uni", enforce_eager=True, dtype="float32",
                 max_model_len=128, model_loader_extra_config={"packed_dir": str(tmp_path / "a")})
    gc.collect()


class _Stack(torch.nn.Module):
    """A stand-in for a vLLM model: embedding, three layers, head; ``load_weights`` copies."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 16, bias=False)

    def load_weights(self, weights):
        return copy_named_weights(self, weights)


@pytest.mark.parametrize("missing, error", [
    ("head.weight", r"not initialized from checkpoint.*'head.weight'"),   # vLLM's own check
    ("layers.1.bias", r"layer layers.1: .* did not load \['layers.1.bias'\]: the checkpoint lacks"),
])
def test_a_tensor_missing_from_the_checkpoint_is_an_error(loader_cls, tmp_path, monkeypatch, missing, error):
    import deepnvme.integrations.vllm as plugin
    monkeypatch.setattr(plugin, "get_tensor_model_parallel_rank", lambda: 0)   # no engine here
    monkeypatch.setattr(plugin, "get_tensor_model_parallel_world_size", lambda: 1)
    cls, load_config = loader_cls
    torch.manual_seed(0)
    state = {k: v for k, v in _Stack().state_dict().items() if k != missing}
    (tmp_path / "model").mkdir()
    save_file(state, str(tmp_path / "model" / "model.safetensors"))
    loader = cls(load_config(load_format="deepnvme_stream", model_loader_extra_config={
        "packed_dir": str(tmp_path / "aligned"), "engine": "threads"}))
    config = types.SimpleNamespace(model=str(tmp_path / "model"), quantization=None, dtype=torch.float32)
    with pytest.raises((ValueError, DeepNVMeError), match=error):
        loader.load_weights(_Stack(), config)


def test_a_model_that_is_not_a_local_safetensors_folder_is_one_clear_error(loader_cls, tmp_path):
    cls, load_config = loader_cls
    loader = cls(load_config(load_format="deepnvme_stream",
                             model_loader_extra_config={"packed_dir": str(tmp_path / "a")}))
    with pytest.raises(DeepNVMeError, match="'deepnvme_stream' reads a local model folder.*meta-llama"):
        loader.download_model(types.SimpleNamespace(model="meta-llama/Llama-3.1-8B"))
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(DeepNVMeError, match="holds no checkpoint.*model.safetensors"):
        loader.download_model(types.SimpleNamespace(model=str(tmp_path)))


def test_the_old_load_format_and_key_still_stream_with_one_warning(loader_cls, tmp_path, monkeypatch, caplog):
    """Deployed configs that say ``deepnvme_offload`` and ``offload_dir`` keep working this release."""
    import warnings

    from vllm.model_executor.model_loader import get_model_loader

    import deepnvme.integrations.vllm as plugin
    from deepnvme import _deprecation
    monkeypatch.setattr(_deprecation, "_warned", set())
    monkeypatch.setattr(plugin, "get_tensor_model_parallel_rank", lambda: 0)   # no engine here
    monkeypatch.setattr(plugin, "get_tensor_model_parallel_world_size", lambda: 1)
    cls, load_config = loader_cls
    torch.manual_seed(0)
    ref = _Stack()
    (tmp_path / "model").mkdir()
    save_file(ref.state_dict(), str(tmp_path / "model" / "model.safetensors"))
    extra = {"offload_dir": str(tmp_path / "aligned"), "engine": "threads"}
    with warnings.catch_warnings(record=True) as record, caplog.at_level("WARNING", logger="deepnvme"):
        warnings.simplefilter("always")
        loaders = [get_model_loader(load_config(load_format="deepnvme_offload",
                                                model_loader_extra_config=dict(extra))) for _ in range(2)]
    deprecations = [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 2, deprecations   # the format and the key, once each
    assert "'deepnvme_offload' is deprecated" in deprecations[0] and "'deepnvme_stream'" in deprecations[0]
    assert "['offload_dir'] is deprecated" in deprecations[1] and "'packed_dir'" in deprecations[1]
    assert sum("deprecated" in r.getMessage() for r in caplog.records) == 2
    assert all(isinstance(loader, cls) for loader in loaders)
    assert loaders[0].options.packed_dir == str(tmp_path / "aligned")
    model = _Stack()
    config = types.SimpleNamespace(model=str(tmp_path / "model"), quantization=None, dtype=torch.float32)
    loaders[0].load_weights(model, config)
    assert (tmp_path / "aligned" / "weights.bin").exists()
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(_apply(model, x), _apply(ref, x), rtol=0, atol=0)
    streamer_of(model).close()
    with pytest.warns(DeprecationWarning, match="OFFLOAD_FORMAT is deprecated"):
        assert plugin.OFFLOAD_FORMAT == "deepnvme_stream"
    with pytest.raises(DeepNVMeError, match="'deepnvme_offload' reads a local model folder"):
        loaders[1].download_model(types.SimpleNamespace(model="meta-llama/Llama-3.1-8B"))


def _apply(model, x):
    h = model.embed(x)
    for layer in model.layers:
        h = layer(h)
    return model.head(h)
