"""``load_format="deepnvme"`` inside vLLM, against vLLM's own ``safetensors`` loader.

Needs the vLLM side environment (``tools/test_vllm.sh`` builds it and runs this file); skipped
where vLLM is not importable. The loader must come from the ``vllm.general_plugins`` entry point
(deepnvme installed in that environment): nothing here imports deepnvme's vLLM module first.
"""

import gc
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import types
import urllib.error
import urllib.request

import pytest
import torch

from ...fakes import copy_named_weights, in_process_vllm, tiny_llama

vllm = in_process_vllm()
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from deepnvme.errors import ConfigError, DeepNVMeError  # noqa: E402

PROMPTS = [[1, 5, 9, 17, 33], [200, 3, 3, 140, 7, 64, 2]]


def _run(model_dir, load_format, dtype, **extra):
    """Greedy tokens, their logprobs and every parameter of vLLM's model after loading."""
    llm = vllm.LLM(model=model_dir, load_format=load_format, skip_tokenizer_init=True,
                   distributed_executor_backend="uni", enforce_eager=True, dtype=dtype,
                   max_model_len=128, seed=0, **extra)
    try:
        params = vllm.SamplingParams(temperature=0, max_tokens=6, logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[{k: v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs] for o in outs]
        weights = llm.apply_model(lambda m: {n: p.detach().clone() for n, p in m.named_parameters()})[0]
    finally:
        del llm
        gc.collect()
    return tokens, logprobs, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deepnvme_equals_vllm_safetensors(tmp_path, dtype, caplog):
    model_dir = tiny_llama(tmp_path / "llama", dtype, layers=2)
    name = str(dtype).removeprefix("torch.")
    with caplog.at_level("INFO", logger="deepnvme.integrations.vllm"):
        ours = _run(model_dir, "deepnvme", name, model_loader_extra_config={"read_window": "128K"})
    assert any("deepnvme: loaded the weights" in r.getMessage() for r in caplog.records)
    theirs = _run(model_dir, "safetensors", name)
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1]
    assert ours[2].keys() == theirs[2].keys() and ours[2]
    for key, value in theirs[2].items():
        assert ours[2][key].dtype == value.dtype and torch.equal(ours[2][key], value), key


@pytest.fixture(scope="module")
def loader_cls():
    """The loader class vLLM resolves for "deepnvme" once its plugins are loaded."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    loader = get_model_loader(LoadConfig(load_format="deepnvme"))
    assert type(loader).__module__ == "deepnvme.integrations.vllm"
    return type(loader), LoadConfig


def test_extra_config_is_validated(loader_cls):
    cls, load_config = loader_cls
    loader = cls(load_config(load_format="deepnvme", model_loader_extra_config={
        "block_size": "2M", "queue_depth": 16, "engine": "threads", "read_window": "8M"}))
    assert (loader.options.io.block_size, loader.options.io.queue_depth) == (2 << 20, 16)
    assert loader.options.read_window == 8 << 20
    with pytest.raises(ConfigError, match="'blok_size'"):
        cls(load_config(load_format="deepnvme", model_loader_extra_config={"blok_size": 1}))


def test_remote_model_name_is_one_clear_error(loader_cls):
    cls, load_config = loader_cls
    loader = cls(load_config(load_format="deepnvme"))
    with pytest.raises(DeepNVMeError, match="local model folder"):
        loader.download_model(types.SimpleNamespace(model="meta-llama/Llama-3.1-8B"))


class _TwoParams(torch.nn.Module):
    """A stand-in for a vLLM model: ``load_weights`` copies the tensors it knows, returns their names."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4))
        self.b = torch.nn.Parameter(torch.zeros(3))

    def load_weights(self, weights):
        return copy_named_weights(self, weights)


def test_every_parameter_must_be_loaded(loader_cls, tmp_path):
    cls, load_config = loader_cls
    loader = cls(load_config(load_format="deepnvme"))
    config = types.SimpleNamespace(model=str(tmp_path), quantization=None)
    safetensors_torch.save_file({"a": torch.arange(4.0), "b": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    model = _TwoParams()
    loader.load_weights(model, config)
    assert torch.equal(model.a, torch.arange(4.0)) and torch.equal(model.b, torch.ones(3))
    safetensors_torch.save_file({"a": torch.arange(4.0)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="not initialized from checkpoint.*'b'"):
        loader.load_weights(_TwoParams(), config)


def test_index_with_unnamed_files_ignored(loader_cls, tmp_path):
    cls, load_config = loader_cls
    safetensors_torch.save_file({"a": torch.arange(4.0)}, str(tmp_path / "s1.safetensors"))
    safetensors_torch.save_file({"b": torch.ones(3)}, str(tmp_path / "s2.safetensors"))
    safetensors_torch.save_file({"b": torch.zeros(3), "c": torch.ones(1)}, str(tmp_path / "old.safetensors"))
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}, f)
    model = _TwoParams()
    cls(load_config(load_format="deepnvme")).load_weights(
        model, types.SimpleNamespace(model=str(tmp_path), quantization=None))
    assert torch.equal(model.b, torch.ones(3))


def _vllm_env():
    """This environment for a child process, with vLLM's own multiprocessing (engine core and
    worker in processes of their own, which load plugins themselves) and deepnvme importable."""
    import deepnvme
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    src = os.path.dirname(os.path.dirname(deepnvme.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def test_the_entry_point_registers_every_format_in_a_fresh_process():
    """Installing deepnvme is all it takes: a process that never imports deepnvme gets every
    format, the old ``deepnvme_offload`` too, from vLLM's plugin loading (as each of vLLM's processes does)."""
    code = textwrap.dedent("""
        import sys
        from vllm.config.load import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.plugins import load_general_plugins
        assert not any(m.startswith("deepnvme") for m in sys.modules)
        load_general_plugins()
        for fmt, extra in (("deepnvme", {}), ("deepnvme_stream", {"packed_dir": "/x"}),
                           ("deepnvme_offload", {"offload_dir": "/x"})):
            loader = get_model_loader(LoadConfig(load_format=fmt, model_loader_extra_config=extra))
            print(fmt, type(loader).__module__, type(loader).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], env=_vllm_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line for line in out.stdout.splitlines() if line.startswith("deepnvme")] == [
        "deepnvme deepnvme.integrations.vllm DeepNVMeModelLoader",
        "deepnvme_stream deepnvme.integrations.vllm DeepNVMeStreamLoader",
        "deepnvme_offload deepnvme.integrations.vllm _OldFormatStreamLoader"], out.stdout   # old name


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def test_openai_server_with_load_format_deepnvme(tmp_path):
    """``python -m vllm.entrypoints.openai.api_server --load-format deepnvme`` with the extra
    config as JSON, engine core and worker in their own processes: completions (token ids and
    logprobs) equal vLLM's in-process ``safetensors`` load."""
    model_dir = tiny_llama(tmp_path / "llama", torch.float32, layers=2)
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
         "--load-format", "deepnvme",
         "--model-loader-extra-config", json.dumps({"read_window": "128K", "engine": "threads"}),
         "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--max-model-len", "128",
         "--seed", "0", "--host", "127.0.0.1", "--port", str(port)],
        env=_vllm_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"the server exited ({server.returncode}):\n" + \
                (tmp_path / "server.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the server did not start in 300 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        got = _post(f"http://127.0.0.1:{port}/v1/completions", {
            "model": model_dir, "prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "logprobs": 3,
            "return_token_ids": True, "return_tokens_as_token_ids": True})
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert "Registered model loader `<class 'deepnvme.integrations.vllm.DeepNVMeModelLoader'>`" in text
    choices = sorted(got["choices"], key=lambda c: c["index"])
    tokens = [c["token_ids"] for c in choices]
    logprobs = [[{int(k.removeprefix("token_id:")): v for k, v in step.items()}
                 for step in c["logprobs"]["top_logprobs"]] for c in choices]
    theirs = _run(model_dir, "safetensors", "float32")
    assert tokens == theirs[0]
    assert logprobs == theirs[1]
