"""Weight streaming into CUDA: same tokens and logits as the model resident on the GPU."""

import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "functional", "inference"))


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_cuda_streaming_matches_resident_model(arch, dtype, prefetch, tmp_path):
    from tiny_transformers import greedy, prompt, tiny_model

    import deepnvme.inference as inf

    ref = tiny_model(arch, dtype)
    ref.save_pretrained(tmp_path / "ckpt")
    ref = ref.cuda()
    ids = prompt().cuda()
    with torch.no_grad():
        ref_logits = ref(ids).logits
    ref_tokens = greedy(ref, ids)
    for model in (inf.load_streamed(str(tmp_path / "ckpt"), device="cuda", prefetch=prefetch),
                  inf.stream_weights(tiny_model(arch, dtype), str(tmp_path / "off"), device="cuda",
                              prefetch=prefetch)):
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.device.type == "cuda"
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(greedy(model, ids), ref_tokens)
        inf.streamer_of(model).close()
