"""Pure parts of the load-path choice: the rule, the fresh-read regions, the mapped windows."""

from __future__ import annotations

import pytest
import torch

from deepnvme.checkpoint._fill_plan import Fill
from deepnvme.checkpoint._fresh import MAX_GAP_FRACTION, regions
from deepnvme.checkpoint._load_path import MARGIN, choose, undecided
from deepnvme.checkpoint._mapped_fill import windows
from deepnvme.config import IOConfig, resolve_config
from deepnvme.errors import ConfigError
from deepnvme.formats.safetensors import StoredTensor


def _rates(fd: float, fm: float, idr: float, im: float) -> dict[str, float]:
    return {"fresh_direct": fd, "fresh_mapped": fm, "into_direct": idr, "into_mapped": im}


def test_mapped_wins_only_by_the_margin():
    fresh, into, why = choose(_rates(1.0, 1.0 * MARGIN, 2.0, 2.0 * MARGIN * 0.99))
    assert (fresh, into) == ("mapped", "direct")
    assert f"fresh: mapped {MARGIN:.2f} GB/s vs O_DIRECT 1.00 GB/s -> mapped" in why
    assert f"into: mapped {2 * MARGIN * 0.99:.2f} GB/s vs O_DIRECT 2.00 GB/s -> direct" in why


def test_direct_wins_ties_and_losses():
    assert choose(_rates(1.0, 1.0, 3.0, 0.5))[:2] == ("direct", "direct")
    assert choose(_rates(0.5, 2.0, 0.5, 2.0))[:2] == ("mapped", "mapped")


def test_slice_probe_names_an_undecided_result_and_the_whole_load_probe():
    # mapped ahead inside the margin: direct, and the reason says so and what to run
    fresh, _, why = choose(_rates(1.0, 1.3, 2.0, 1.0), slices=True)
    assert fresh == "direct"
    assert f"mapped ahead by less than the probe's {MARGIN:.1f}x margin: `deepnvme tune --load`" in why
    assert why.count("tune --load") == 1  # into: direct ahead, nothing undecided
    # whole-load timings, a clear result, or direct ahead: no hint
    assert "tune --load" not in choose(_rates(1.0, 1.3, 2.0, 1.0), margin=1.1)[2]
    assert "tune --load" not in choose(_rates(1.0, 2.0, 2.0, 1.0), slices=True)[2]
    assert "tune --load" not in choose(_rates(1.0, 0.9, 2.0, 1.0), slices=True)[2]
    # the log level of the first use follows the same rule
    assert undecided(_rates(1.0, 1.3, 2.0, 1.0))
    assert not undecided(_rates(1.0, 2.0, 2.0, 1.0)) and not undecided(_rates(1.0, 0.9, 2.0, 1.0))


def test_load_path_setting_is_validated():
    assert resolve_config({"load_path": "Mapped"}).load_path == "mapped"
    assert resolve_config(env={"DEEPNVME_LOAD_PATH": "direct"}).load_path == "direct"
    assert IOConfig().load_path == "auto"
    with pytest.raises(ConfigError, match="unknown load path 'mmap'.*auto, direct, mapped"):
        resolve_config({"load_path": "mmap"})
    with pytest.raises(ConfigError, match="load path"):
        IOConfig(load_path="fast")


def _st(name: str, file: str, offset: int, nbytes: int) -> StoredTensor:
    return StoredTensor(name, file, offset, nbytes, torch.uint8, (nbytes,))


def test_regions_span_each_file_and_skip_empty_tensors():
    src = {"a": _st("a", "f1", 100, 50), "b": _st("b", "f1", 150, 50), "z": _st("z", "f1", 10, 0),
           "c": _st("c", "f2", 8, 8)}
    out = regions(src)
    assert [(f, lo, hi, [n for n, _ in items]) for f, lo, hi, items in out] == [
        ("f1", 100, 200, ["a", "b"]), ("f2", 8, 16, ["c"])]


def test_regions_split_when_gaps_would_waste_memory():
    gap = int(100 / MAX_GAP_FRACTION)  # far more unread bytes than the tensors' own
    src = {"a": _st("a", "f", 0, 100), "b": _st("b", "f", 100 + gap, 100)}
    assert [(lo, hi) for _, lo, hi, _ in regions(src)] == [(0, 100), (100 + gap, 200 + gap)]


def _fill(name: str, offset: int, nbytes: int) -> Fill:
    return Fill(name, _st(name, "f", offset, nbytes), "direct")


def test_windows_keep_file_order_and_the_byte_cap():
    fills = [_fill("c", 300, 100), _fill("a", 0, 100), _fill("b", 100, 150), _fill("big", 400, 1000)]
    got = [[f.name for f in w] for w in windows(fills, window=250)]
    assert got == [["a", "b"], ["c"], ["big"]]
