"""``deepnvme plan --params``'s storage arithmetic against numbers worked out by hand (no disk)."""

from __future__ import annotations

import pytest

from deepnvme.bench import parse_count, size_storage
from deepnvme.bench.sizing import explain

G = 10**9


@pytest.mark.parametrize("text, value", [("7B", 7 * G), ("70b", 70 * G), ("350M", 350 * 10**6),
                                         ("1.5T", 1_500 * G), ("125K", 125_000), ("42", 42),
                                         (" 13 B ", 13 * G), ("0.5B", 500_000_000)])
def test_parse_count(text, value) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize("bad", ["", "7X", "B", "-7B", "0", "7 BB", "1e9"])
def test_parse_count_rejects(bad) -> None:
    with pytest.raises(ValueError, match="parameter count"):
        parse_count(bad)


def test_7b_bf16_zero3_everything_offloaded_one_rank() -> None:
    s = size_storage(params=7 * G, dtype="bf16", zero_stage=3, ranks=1, offload_optimizer=True,
                     offload_params=True, keep=3, step_seconds=10.0, checkpoint_every=100,
                     drive_gbps=5.0, drive_bytes=3840 * G)
    # on NVMe: optimizer state 7e9 x 12 B = 84 GB, fp32 gradients 7e9 x 4 B = 28 GB,
    # bf16 parameters 7e9 x 2 B = 14 GB: 126 GB
    assert (s.optimizer_state_bytes, s.gradient_bytes, s.param_bytes) == (84 * G, 28 * G, 14 * G)
    assert s.offload_bytes == 126 * G
    # checkpoint 7e9 x (2 + 12) = 98 GB; 3 kept + 1 being written = 392 GB; capacity 518 GB
    assert s.checkpoint_bytes == 98 * G and s.checkpoint_store_bytes == 392 * G
    assert s.capacity_bytes == 518 * G
    # per step: read 84 + 28 + 2 x 14 = 140 GB, write 84 + 28 + 14 = 126 GB; 266 GB / 10 s
    assert (s.read_bytes_per_step, s.write_bytes_per_step) == (140 * G, 126 * G)
    assert s.offload_gbps == pytest.approx(26.6)
    # 98 GB every 100 x 10 s = 0.098 GB/s; 26.698 GB/s / 5 GB/s -> 6 drives; 518 GB / 3.84 TB -> 1
    assert s.checkpoint_gbps == pytest.approx(0.098) and s.needed_gbps == pytest.approx(26.698)
    assert (s.drives_for_bandwidth, s.drives_for_capacity, s.drives) == (6, 1, 6)
    assert s.checkpoint_seconds == pytest.approx(98 / 30)  # 98 GB on 6 x 5 GB/s
    # pinned host memory: 5 x 1e8 x 2 B = 1 GB; 4 x min(1e9, 7e9) x 4 B = 16 GB
    assert (s.param_buffer_bytes, s.optimizer_buffer_bytes) == (1 * G, 16 * G)
    text = "\n".join(explain(s))
    for line in ("NVMe capacity: 518.0 GB", "optimizer state 84.0 GB = 7,000,000,000 params x 12 B",
                 "read 140.0 GB, write 126.0 GB", "6 for bandwidth (26.70 GB/s)", "-> 6",
                 "one checkpoint on 6 drive(s): 3.27 s (19.60 s on one)"):
        assert line in text, line


def test_70b_fp16_zero3_optimizer_only_over_8_ranks() -> None:
    s = size_storage(params=70 * G, dtype="fp16", zero_stage=3, ranks=8, offload_optimizer=True,
                     offload_params=False, keep=1, step_seconds=20.0, drive_gbps=7.0)
    # 70e9 x 16 B = 1120 GB of state and gradients (140 GB per rank); parameters stay in memory
    assert s.offload_bytes == 1120 * G and s.param_bytes == 0
    # checkpoint 70e9 x 14 = 980 GB, 2 on disk; per step 1120 GB each way = 2240 GB / 20 s
    assert s.checkpoint_store_bytes == 1960 * G and s.capacity_bytes == 3080 * G
    assert s.offload_gbps == pytest.approx(112.0) and s.checkpoint_gbps is None
    assert s.drives_for_bandwidth == 16 and s.drives_for_capacity is None and s.drives == 16
    # the optimizer's buffers hold one sub-group: min(1e9, 70e9 / 8) x 4 B x 4
    assert s.optimizer_buffer_bytes == 16 * G and s.param_buffer_bytes == 0
    assert "per rank: 140.0 GB offloaded, 245.0 GB of checkpoints" in "\n".join(explain(s))


def test_stage_0_and_2_replicate_what_is_not_partitioned() -> None:
    s0 = size_storage(params=G, dtype="fp32", zero_stage=0, ranks=4, offload_params=True)
    # stage 0: every rank holds all 16 B of optimizer state and gradient, and 4 B of parameters
    assert s0.optimizer_state_bytes == 48 * G and s0.gradient_bytes == 16 * G
    assert s0.param_bytes == 16 * G and s0.checkpoint_bytes == 16 * G
    s2 = size_storage(params=G, dtype="bf16", zero_stage=2, ranks=4, offload_params=True)
    assert s2.optimizer_state_bytes == 12 * G and s2.param_bytes == 8 * G  # 2 B x 4 ranks
    assert s2.read_bytes_per_step == 16 * G + 16 * G and s2.write_bytes_per_step == 16 * G + 8 * G


def test_nothing_offloaded_and_no_speed_leave_checkpoints_only() -> None:
    s = size_storage(params=G, offload_optimizer=False, offload_params=False, keep=0,
                     drive_bytes=G)
    assert s.offload_bytes == 0 and s.capacity_bytes == 14 * G  # one checkpoint being written
    assert s.read_bytes_per_step == s.write_bytes_per_step == 0
    assert s.offload_gbps is None and s.drives_for_capacity == 14 and s.drives == 14
    assert s.checkpoint_seconds is None
    assert "give --drive-gbps" in "\n".join(explain(s))


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "int8"}, "dtype must be one of"), ({"zero_stage": 4}, "zero_stage"),
    ({"ranks": 0}, "ranks must be >= 1"), ({"step_seconds": 0.0}, "step_seconds must be > 0"),
    ({"drive_gbps": -1.0}, "drive_gbps must be > 0")])
def test_bad_inputs_name_the_input(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        size_storage(params=G, **kwargs)
