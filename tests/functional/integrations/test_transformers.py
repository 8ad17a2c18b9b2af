"""deepnvme.integrations.transformers against transformers' own from_pretrained / save_pretrained."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")

from deepnvme import CheckpointMismatchError  # noqa: E402
from deepnvme.integrations.transformers import from_pretrained, save_pretrained  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 17, 33, 2], [200, 3, 3, 140, 7, 64]])


def _gpt2():
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32)


def _llama():
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                    max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, cfg in (("gpt2", _gpt2()), ("llama", _llama())):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        out[name] = root / name
        model.save_pretrained(out[name], max_shard_size="40KB")  # several shards and an index
    return out


def _same_model(ref, ours):
    assert type(ref) is type(ours) and not ours.training
    a, b = ref.state_dict(), ours.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    for (k1, b1), (k2, b2) in zip(ref.named_buffers(), ours.named_buffers()):
        assert k1 == k2 and torch.equal(b1, b2), k1


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, "float16"])
def test_outputs_equal_transformers(folders, name, dtype):
    ref = transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype=dtype)
    ours = from_pretrained("AutoModelForCausalLM", folders[name], dtype=dtype)
    _same_model(ref, ours)
    with torch.no_grad():
        assert torch.equal(ref(IDS).logits, ours(IDS).logits)
    tied = ours.lm_head.weight.data_ptr() == ours.get_input_embeddings().weight.data_ptr()
    assert tied == (name == "gpt2")  # GPT-2 ties its head to the embedding; this Llama does not
    assert ours.generation_config.to_dict() == ref.generation_config.to_dict()


def test_concrete_class_and_base_model_from_head_checkpoint(folders):
    ours = from_pretrained(transformers.GPT2LMHeadModel, folders["gpt2"])
    assert isinstance(ours, transformers.GPT2LMHeadModel)
    base_ref = transformers.AutoModel.from_pretrained(folders["gpt2"])
    base = from_pretrained(transformers.AutoModel, folders["gpt2"])  # "transformer." prefix dropped
    _same_model(base_ref, base)


def test_missing_weights_are_initialised_and_reported(folders):
    ref, info_ref = transformers.GPT2ForSequenceClassification.from_pretrained(
        folders["gpt2"], num_labels=3, output_loading_info=True)
    ours, info = from_pretrained("GPT2ForSequenceClassification", folders["gpt2"], num_labels=3,
                                 output_loading_info=True)
    assert sorted(info["missing_keys"]) == sorted(info_ref["missing_keys"]) == ["score.weight"]
    assert sorted(info["unexpected_keys"]) == sorted(info_ref["unexpected_keys"])
    score = ours.score.weight
    assert score.shape == (3, 64) and torch.isfinite(score).all() and 0 < score.std() < 0.1
    loaded = {k: v for k, v in ours.state_dict().items() if k != "score.weight"}
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in loaded.items())


def test_shape_mismatch_raises_before_reading(folders):
    with pytest.raises(CheckpointMismatchError, match="wte"):
        from_pretrained("AutoModelForCausalLM", folders["gpt2"], vocab_size=300)


def test_bad_arguments(folders, tmp_path):
    with pytest.raises(TypeError, match="not_a_setting"):
        from_pretrained("AutoModelForCausalLM", folders["gpt2"], not_a_setting=1)
    with pytest.raises(ValueError, match="NoSuchModel"):
        from_pretrained("NoSuchModel", folders["gpt2"])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        from_pretrained("AutoModelForCausalLM", tmp_path / "nowhere")
    with pytest.raises(ValueError, match="dtype"):
        from_pretrained("AutoModelForCausalLM", folders["gpt2"], dtype="float99")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_save_pretrained_writes_what_transformers_writes(folders, tmp_path, name):
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[name])
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    (ours).mkdir()
    (ours / "model-00009-of-00010.safetensors").write_bytes(b"stale")  # an older save's shard: removed
    save_pretrained(model, ours, max_shard_size="40KB")
    model.save_pretrained(theirs, max_shard_size="40KB")
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    for meta in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        assert json.loads((ours / meta).read_text()) == json.loads((theirs / meta).read_text()), meta
    for shard in [f for f in os.listdir(theirs) if f.endswith(".safetensors")]:
        a = safetensors_torch.load_file(ours / shard)
        b = safetensors_torch.load_file(theirs / shard)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), shard
        with open(ours / shard, "rb") as f:  # deepnvme wrote it: header padded to a 4096-byte boundary
            assert (8 + int.from_bytes(f.read(8), "little")) % 4096 == 0
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) == (name == "llama")  # tied weight stored once
    back = transformers.AutoModelForCausalLM.from_pretrained(ours)
    _same_model(model, back)


def test_save_pretrained_single_file_round_trip(folders, tmp_path):
    model = from_pretrained("AutoModelForCausalLM", folders["llama"], dtype=torch.bfloat16)
    save_pretrained(model, tmp_path)
    assert "model.safetensors" in os.listdir(tmp_path)
    assert "model.safetensors.index.json" not in os.listdir(tmp_path)
    _same_model(model, from_pretrained("AutoModelForCausalLM", tmp_path))
