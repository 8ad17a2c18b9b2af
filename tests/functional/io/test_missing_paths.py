"""A missing folder or file is one kind of error everywhere: a ``FileNotFoundError`` that names
the path (and nothing unknown), whichever entry point met it."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import deepnvme
from deepnvme.data import TokenDataset
from deepnvme.io import durable


def _writes(folder):
    """Entry points that create a file in ``folder``, by name."""
    t = torch.arange(1024, dtype=torch.uint8)

    def handle():
        with deepnvme.AioHandle() as h:
            h.sync_pwrite(t, str(folder / "f.bin"))

    def kept():
        with deepnvme.AioHandle() as h:
            h.submit_write(t, str(folder / "f.bin"), keep_open=True).result()

    def many():
        with deepnvme.AioHandle() as h:
            h.write_many(str(folder / "f.bin"), [(t, 0), (t, 4096)]).result()

    def json_file():
        durable.write_json(str(folder / "f.json"), {"a": 1})

    def save():
        deepnvme.save({"t": t}, folder / "f.pt")
    return {"sync_pwrite": handle, "submit_write keep_open": kept,
            "write_many": many, "write_json": json_file, "save": save}


@pytest.mark.parametrize("entry", sorted(_writes("x")))
def test_writing_into_a_missing_folder(tmp_path, entry):
    folder = tmp_path / "missing"
    with pytest.raises(FileNotFoundError) as info:
        _writes(folder)[entry]()
    err = info.value
    assert err.errno == errno.ENOENT and str(folder) in str(err) and "None" not in str(err)
    assert not folder.exists()


def test_reading_a_missing_file(tmp_path):
    path = str(tmp_path / "absent.bin")
    with deepnvme.AioHandle() as h:
        for call in (lambda: h.sync_pread(torch.empty(8, dtype=torch.uint8), path),
                     lambda: h.read_many(path, [(torch.empty(8, dtype=torch.uint8), 0)]).result()):
            with pytest.raises(FileNotFoundError) as info:
                call()
            assert path in str(info.value) and "None" not in str(info.value)
    with pytest.raises(FileNotFoundError, match="absent"):
        TokenDataset(tmp_path / "absent", seq_len=4)
    assert not os.path.exists(path)
