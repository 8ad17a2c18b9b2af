"""from_deepspeed_config: DeepSpeed's storage-guide config accepted, impossible values refused
with the key named, unused keys named in one warning. No disk is touched."""

import copy
import warnings

import pytest
import torch

from deepnvme import ConfigError, from_deepspeed_config
from deepnvme.offload import OptimizerOffloadSettings, ParamOffloadSettings

# the example of DeepSpeed's storage guide (ZeRO stage 3, both offloads on NVMe)
GUIDE = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
    },
    "aio": {"block_size": 1048576, "queue_depth": 32, "thread_count": 8, "single_submit": False,
            "overlap_events": True, "use_gds": True},
}


def guide(**aio):
    cfg = copy.deepcopy(GUIDE)
    cfg["aio"].update(aio)
    return cfg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_the_guide_example_asks_for_gds_which_needs_a_gpu():
    with pytest.raises(ConfigError, match=r"aio.use_gds is true but this machine has no CUDA GPU"):
        from_deepspeed_config(GUIDE)


def test_the_guide_example_with_a_gpu_is_accepted_with_one_warning_naming_use_gds(monkeypatch):
    """As on a machine with a CUDA GPU (the check is torch.cuda.is_available(), faked here;
    tests/gpu/ runs it for real): accepted, and use_gds, which the CPU offload cannot use, is
    named with the other unused keys in the one warning."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = from_deepspeed_config(GUIDE)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "aio.use_gds" in message and "aio.overlap_events" in message
    assert s.param is not None and s.optimizer is not None and s.io.queue_depth == 32


def test_the_guide_example_without_gds_is_read_with_one_warning_naming_unused_keys():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = from_deepspeed_config(guide(use_gds=False))
    assert len(caught) == 1
    message = str(caught[0].message)
    for key in ("train_micro_batch_size_per_gpu", "zero_optimization.offload_param.max_in_cpu",
                "zero_optimization.offload_param.pin_memory",
                "zero_optimization.offload_optimizer.fast_init", "aio.overlap_events"):
        assert key in message and key in s.unused_keys
    assert s.stage == 3 and "zero_optimization.stage" not in s.unused_keys   # used: shards under dist
    for key in ("buffer_size", "nvme_path", "block_size", "queue_depth", "thread_count",
                "single_submit", "use_gds"):   # used (use_gds false: nothing asked of GDS)
        assert key not in message, key
    assert s.param == ParamOffloadSettings(nvme_path="/local_nvme", buffer_count=5,
                                           buffer_size=100_000_000, max_in_cpu=1_000_000_000,
                                           pin_memory=True)
    assert s.optimizer == OptimizerOffloadSettings(nvme_path="/local_nvme", buffer_count=4,
                                                   pin_memory=True)
    assert s.param.max_in_memory_bytes(4) == 5 * 100_000_000 * 4
    io = s.io
    assert (io.block_size, io.queue_depth, io.intra_op_parallelism, io.single_submit,
            io.overlap_events, io.use_gds) == (1 << 20, 32, 8, False, True, False)


def test_a_json_file_path_is_read(tmp_path):
    import json
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(guide(use_gds=False)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert from_deepspeed_config(str(path)).param.buffer_count == 5
    with pytest.raises(ConfigError, match="cannot read the DeepSpeed config"):
        from_deepspeed_config(tmp_path / "missing.json")


@pytest.mark.parametrize("section,key,value,match", [
    ("offload_param", "nvme_path", None, r"offload_param.nvme_path is required"),
    ("offload_optimizer", "nvme_path", "", r"offload_optimizer.nvme_path is required"),
    ("offload_param", "buffer_size", 0, r"offload_param.buffer_size must be an integer >= 1, got 0"),
    ("offload_param", "buffer_count", 0, r"offload_param.buffer_count must be an integer >= 1"),
    ("offload_optimizer", "buffer_count", 1, r"offload_optimizer.buffer_count must be an integer >= 2"),
    ("offload_param", "buffer_size", 1.5, r"buffer_size must be an integer"),
    ("offload_param", "device", "disk", r"offload_param.device must be one of"),
    ("offload_param", "pin_memory", "yes", r"offload_param.pin_memory must be true or false"),
])
def test_impossible_values_name_the_key(section, key, value, match):
    cfg = guide(use_gds=False)
    if value is None:
        del cfg["zero_optimization"][section][key]
    else:
        cfg["zero_optimization"][section][key] = value
    with pytest.raises(ConfigError, match=match):
        from_deepspeed_config(cfg)


def test_unknown_aio_keys_and_bad_shapes_are_refused():
    with pytest.raises(ConfigError, match="unknown 'aio' config key 'depth'"):
        from_deepspeed_config({"aio": {"depth": 3}})
    with pytest.raises(ConfigError, match="zero_optimization must be an object"):
        from_deepspeed_config({"zero_optimization": 3})
    with pytest.raises(ConfigError, match="a DeepSpeed config is a dict or a JSON file path"):
        from_deepspeed_config(42)  # type: ignore[arg-type]


def test_cpu_devices_keep_things_in_memory_and_build_a_plain_optimizer():
    cfg = {"zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True},
                                 "offload_optimizer": {"device": "none"}}}
    with pytest.warns(UserWarning, match="offload_param.pin_memory"):
        s = from_deepspeed_config(cfg)
    assert s.param is None and s.optimizer is None
    model = torch.nn.Linear(2, 2)
    offload, opt = s.apply(model, torch.optim.SGD, lr=0.1)
    assert offload is None and type(opt) is torch.optim.SGD


def test_no_warning_when_every_key_is_used():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = from_deepspeed_config({"zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": "/x", "buffer_count": 2, "buffer_size": 10}},
            "aio": {"queue_depth": 8}})
    assert s.param is not None and s.param.max_in_memory_bytes(2) == 40 and s.io.queue_depth == 8


def test_the_persistence_threshold_keeps_small_parameters_in_memory(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the key acts: not named as unused
        s = from_deepspeed_config({"zero_optimization": {
            "stage3_param_persistence_threshold": 1e3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4,
                              "buffer_size": 1 << 16}}})
    assert s.param is not None and s.param.persistence_threshold == 1000
    assert s.param.min_offload_bytes(4) == 4000
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))   # 4096, 64, 512, 8
    offload = s.offload_model(model)
    assert offload is not None
    try:
        resident = sorted(d.name for d, _ in offload._entries.values() if d.resident)
        assert resident == ["0.bias", "1.bias", "1.weight"]   # fewer than 1000 elements
    finally:
        offload.close()


def test_the_persistence_threshold_without_nvme_params_is_unused_and_checked():
    with pytest.warns(UserWarning, match="zero_optimization.stage3_param_persistence_threshold"):
        from_deepspeed_config({"zero_optimization": {"stage3_param_persistence_threshold": 10}})
    with pytest.raises(ConfigError, match=r"zero_optimization.stage3_param_persistence_threshold "
                                          r"must be an integer >= 0, got -1"):
        from_deepspeed_config({"zero_optimization": {
            "stage3_param_persistence_threshold": -1,
            "offload_param": {"device": "nvme", "nvme_path": "/x"}}})


def test_sub_group_size_sizes_the_nvme_optimizer_and_slices_larger_parameters(tmp_path):
    """DeepSpeed's sub_group_size (elements) becomes NVMeOptimizer's sub_group_bytes: a weight
    of 4096 elements under a sub-group of 1024 is updated in 4 slices."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the key acts: not named as unused
        s = from_deepspeed_config({"zero_optimization": {
            "sub_group_size": 1024,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}})
    assert s.optimizer is not None and s.optimizer.sub_group_size == 1024
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = s.make_optimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    try:
        assert opt.sub_group_bytes == 4096 and opt.num_sliced_params == 1
        assert opt.num_sub_groups == 4 + 1
    finally:
        opt.close()


def test_sub_group_size_without_the_nvme_optimizer_is_unused_and_checked():
    with pytest.warns(UserWarning, match="zero_optimization.sub_group_size"):
        from_deepspeed_config({"zero_optimization": {"sub_group_size": 10}})
    with pytest.raises(ConfigError, match=r"zero_optimization.sub_group_size must be an integer "
                                          r">= 1, got 0"):
        from_deepspeed_config({"zero_optimization": {
            "sub_group_size": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})
