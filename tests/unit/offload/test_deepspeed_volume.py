"""from_deepspeed_config: an nvme_path that lists one directory per drive becomes a Volume."""

from __future__ import annotations

import pytest

from deepnvme import ConfigError, Volume, from_deepspeed_config

from .test_deepspeed_config import guide


def test_a_list_of_nvme_paths_is_a_volume(tmp_path):
    cfg = guide(use_gds=False)
    drives = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = drives
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = tuple(drives)
    with pytest.warns(UserWarning):
        s = from_deepspeed_config(cfg)
    assert s.param is not None and s.optimizer is not None
    assert s.param.nvme_path == Volume(drives) == s.optimizer.nvme_path


@pytest.mark.parametrize("value,match", [
    ([], r"offload_param.nvme_path is required"),
    (["/a", ""], r"offload_param.nvme_path is required"),
    (["/a", "/a"], r"offload_param.nvme_path: Volume: directory '/a' is listed twice"),
])
def test_bad_lists_name_the_key(value, match):
    cfg = guide(use_gds=False)
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = value
    with pytest.raises(ConfigError, match=match):
        from_deepspeed_config(cfg)
