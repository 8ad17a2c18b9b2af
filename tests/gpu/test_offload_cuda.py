"""Parameter offload on a machine with a CUDA GPU. Skipped without CUDA.

DeepSpeed's storage-guide config (``use_gds: true``) is accepted here, with ``aio.use_gds`` named
in the one warning (the offload moves CPU tensors). Training a CUDA model with offloaded
parameters is not supported yet (issue 16 asks for it through the staging path): CUDA
parameters are refused with an error naming the parameter and its device, never trained wrong.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import deepnvme

from ..unit.offload.test_deepspeed_config import GUIDE

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_storage_guide_example_is_accepted_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = deepnvme.from_deepspeed_config(GUIDE)
    assert len(caught) == 1 and "aio.use_gds" in str(caught[0].message)
    assert settings.param is not None and settings.optimizer is not None


def test_cuda_parameters_are_refused_naming_the_parameter(tmp_path):
    model = torch.nn.Linear(8, 8).cuda()
    with pytest.raises(ValueError, match=r"offload_parameters needs CPU parameters; weight is on cuda"):
        deepnvme.offload_parameters(model, tmp_path, max_in_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"NVMeOptimizer needs CPU parameters"):
        deepnvme.NVMeOptimizer(model.parameters(), torch.optim.SGD, swap_dir=tmp_path, lr=0.1)
