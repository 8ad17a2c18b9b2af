"""The timed primitives behind bench/tune, on real files."""

from __future__ import annotations

import shutil

import pytest
import torch

from deepnvme.bench._measure import Measurer, check_file, fill_pattern
from deepnvme.config import resolve_config
from deepnvme.errors import DeepNVMeError, ValidationError


def test_check_file_detects_a_flipped_byte(tmp_path) -> None:
    data = torch.empty(100_000, dtype=torch.uint8)
    fill_pattern(data, seed=3)
    path = tmp_path / "f"
    path.write_bytes(data.numpy().tobytes())
    check_file(str(path), data)
    raw = bytearray(path.read_bytes())
    raw[77_777] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ValidationError) as exc:
        check_file(str(path), data)
    assert exc.value.path == str(path)


@pytest.mark.parametrize("tool", ["deepnvme", "python", "fio"])
def test_every_tool_writes_and_reads_the_whole_file(tool, tmp_path) -> None:
    buf = torch.empty(1 << 20, dtype=torch.uint8)
    fill_pattern(buf, seed=1)
    path = str(tmp_path / "f")
    m = Measurer(path=path, buf=buf, config=resolve_config({"block_size": 256 << 10,
                                                           "queue_depth": 4}))
    try:
        if tool == "fio" and shutil.which("fio") is None:  # without fio: a clear error instead
            with pytest.raises(DeepNVMeError, match="fio is not installed"):
                m.measure(tool, write=True)
            return
        w = m.measure(tool, write=True)
        assert (tmp_path / "f").stat().st_size == 1 << 20
        if tool != "fio":  # fio writes its own data pattern
            check_file(path, buf)
        r = m.measure(tool, write=False)
    finally:
        m.close()
    for t in (w, r):
        assert t.seconds > 0 and t.end >= t.start
