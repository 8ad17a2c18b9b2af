"""``stream_layers`` on a small engine-like model (no vLLM): outputs equal the in-memory model's,
the aligned copy is reused, and the budget decides which layers stay in memory."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from deepnvme.errors import ConfigError, DeepNVMeError
from deepnvme.inference import stream_stats
from deepnvme.integrations._layer_stream import stream_layers, stream_options

from ...fakes import copy_named_weights


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.scale = nn.Parameter(torch.ones(32))

    def forward(self, h):
        return h + torch.tanh(self.proj(h)) * self.scale


class Toy(nn.Module):
    """Like a serving engine's model: ``load_weights(pairs)`` copies and returns the names."""

    def __init__(self, layers=4):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def load_weights(self, weights):
        return copy_named_weights(self, weights)


LAYER_BYTES = (32 * 32 + 32 + 32) * 4
FIXED = (64 * 32 * 2) * 4


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    ref = Toy().eval()
    (tmp_path / "model").mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "model" / "model.safetensors"))
    return ref, str(tmp_path / "model")


class Renamed(Toy):
    """An engine that renames checkpoint tensors (``blocks.N`` -> ``layers.N``) while loading."""

    def load_weights(self, weights):
        return super().load_weights((n.replace("blocks.", "layers."), t) for n, t in weights)


def _stream(model_dir, aligned, cls=Toy, **extra):
    torch.manual_seed(1)
    model = cls().eval()
    options = stream_options({"packed_dir": aligned, "engine": "threads", "read_window": 4096, **extra},
                              load_format="deepnvme_stream")
    result = stream_layers(model, model_dir, options, load=model.load_weights, fingerprint={"engine": "toy"})
    return model, result


def test_streamed_model_computes_what_the_in_memory_one_does(checkpoint, tmp_path):
    ref, model_dir = checkpoint
    x = torch.randint(0, 64, (3, 5))
    aligned = str(tmp_path / "aligned")
    model, result = _stream(model_dir, aligned, memory_budget=FIXED + LAYER_BYTES, prefetch=1)
    assert (result.streamed, result.resident, result.converted) == ((0, 1, 3), (2,), True)
    assert result.streamed_bytes == 3 * LAYER_BYTES and result.resident_bytes == LAYER_BYTES
    assert result.staging_bytes == 2 * 8192   # (prefetch + 1) x a layer's 4096-aligned block
    assert result.loaded == {n for n, _ in ref.named_parameters()}
    with torch.no_grad():
        assert torch.equal(model(x), ref(x)) and torch.equal(model(x), ref(x))
    stats = stream_stats(model)
    assert stats.blocks_loaded == 6 and stats.bytes_read == 6 * 8192
    assert model.layers[0].proj.weight.stride() == (0, 0)   # released between uses
    again, result = _stream(model_dir, aligned)   # no budget: every layer streams, copy reused
    assert (result.streamed, result.converted) == ((0, 1, 2, 3), False)
    with torch.no_grad():
        assert torch.equal(again(x), ref(x))


def test_everything_in_budget_streams_nothing(checkpoint, tmp_path):
    ref, model_dir = checkpoint
    model, result = _stream(model_dir, str(tmp_path / "aligned"), memory_budget="1M")
    assert result.streamed == () and result.resident == (0, 1, 2, 3)
    assert not (tmp_path / "aligned").exists()
    x = torch.randint(0, 64, (2, 3))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_budget_below_the_non_layer_weights_names_the_key(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="'memory_budget'.*embeddings"):
        _stream(checkpoint[1], str(tmp_path / "aligned"), memory_budget=FIXED - 1)


def test_checkpoint_names_outside_the_layers_are_one_clear_error(tmp_path):
    torch.manual_seed(0)
    sd = {k.replace("layers.", "blocks."): v for k, v in Toy().state_dict().items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(DeepNVMeError, match="names that start with the layers. module names"):
        _stream(str(tmp_path), str(tmp_path / "aligned"), cls=Renamed)


class LinearBase(nn.Module):
    """Stands in for vLLM's linear layer base class (its layers are not nn.Linear)."""


class FusedLinear(LinearBase):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)

    def forward(self, h):
        return h @ self.weight.t()


class FusedBlock(Block):
    def __init__(self):
        super().__init__()
        self.proj = FusedLinear(32, 32)


class FusedToy(Toy):
    def __init__(self, layers=4):
        super().__init__(layers)
        self.layers = nn.ModuleList(FusedBlock() for _ in range(layers))


@pytest.mark.parametrize("mode, bound", [("int8", 0.02), ("int4", 0.8)])
def test_quantised_layers_stream_at_a_fraction_of_the_bytes(checkpoint, tmp_path, mode, bound):
    ref, model_dir = checkpoint
    x = torch.randint(0, 64, (3, 5))
    aligned = str(tmp_path / "aligned")
    plain, _ = _stream(model_dir, str(tmp_path / "plain"))
    model, result = _stream(model_dir, aligned, quantize=mode, group_size=16, memory_budget=FIXED + LAYER_BYTES)
    assert result.streamed == (0, 1, 3) and result.converted
    with torch.no_grad():
        want, got = ref(x), model(x)
        model(x)
        assert not torch.equal(got, want) and (got - want).abs().max() < bound
        assert torch.equal(model.layers[2](torch.ones(1, 32)), ref.layers[2](torch.ones(1, 32)))  # kept: exact
        plain(x)
        plain(x)
    assert stream_stats(model).bytes_read < 0.6 * stream_stats(plain).bytes_read
    # the same folder with another setting is rewritten, never read as this one
    again, result = _stream(model_dir, aligned, quantize=mode, group_size=16)
    assert not result.converted
    other, result = _stream(model_dir, aligned, group_size=None)
    assert result.converted
    with torch.no_grad():
        assert torch.equal(other(x), ref(x))
    # vLLM-style linear layers (a LinearBase that is not nn.Linear) are quantised too
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    torch.manual_seed(0)
    fref = FusedToy().eval()
    save_file({k: v.contiguous() for k, v in fref.state_dict().items()}, str(fused_dir / "model.safetensors"))
    fused, _ = _stream(str(fused_dir), str(tmp_path / "fa"), cls=FusedToy, quantize=mode, group_size=16)
    with torch.no_grad():
        got = fused(x)
    assert not torch.equal(got, fref(x)) and (got - fref(x)).abs().max() < bound


def test_quantise_options_are_checked_naming_the_keys(tmp_path):
    with pytest.raises(ConfigError, match="quantize.*'quantize', 'group_size'"):
        stream_options({"packed_dir": str(tmp_path), "quantize": "int3"}, load_format="deepnvme_stream")
    with pytest.raises(ConfigError, match="group_size"):
        stream_options({"packed_dir": str(tmp_path), "quantize": "int8", "group_size": 0},
                       load_format="deepnvme_stream")
