"""offload_parameters and NVMeOptimizer in multi-rank jobs: FSDP2 shards on 2 and 4 gloo ranks, DDP."""

from __future__ import annotations

import pytest
import torch

from . import _offload_workers
from ._ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")


def test_fsdp2_shards_offloaded_per_rank_train_bitwise_on_two_ranks(tmp_path):
    run_ranks(_offload_workers.fsdp, 2, str(tmp_path), str(tmp_path), deadline=150)


@pytest.mark.slow
def test_fsdp2_shards_offloaded_per_rank_train_bitwise_on_four_ranks(tmp_path):
    run_ranks(_offload_workers.fsdp, 4, str(tmp_path), str(tmp_path), deadline=300)


def test_ddp_with_nvme_optimizer_is_bitwise_with_each_rank_state_in_its_own_directory(tmp_path):
    run_ranks(_offload_workers.ddp, 2, str(tmp_path), str(tmp_path), deadline=90)


@pytest.mark.parametrize("fuse", [True, "auto"])
def test_fsdp2_update_fused_into_the_backward_is_bitwise(tmp_path, fuse):
    run_ranks(_offload_workers.fsdp_fused, 2, str(tmp_path), str(tmp_path), fuse, deadline=150)
