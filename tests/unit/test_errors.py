"""Error messages name what is known about the failing transfer, never a placeholder ``None``."""

from __future__ import annotations

import errno
import pickle

import pytest

from deepnvme.errors import DeepNVMeIOError, FileNotFoundIOError, PermissionIOError, ShortTransferError, ValidationError


@pytest.mark.parametrize("where,expected", [
    ({"path": "/d/f", "offset": 4096, "size": 512}, "boom (file '/d/f', offset 4096, size 512)"),
    ({"path": "/d/f", "offset": None, "size": None}, "boom (file '/d/f')"),
    ({"path": "/d/f", "offset": None, "size": 512}, "boom (file '/d/f', size 512)"),
    ({"path": None, "offset": 0, "size": None}, "boom (offset 0)"),
    ({"path": None, "offset": None, "size": None}, "boom"),
])
def test_the_message_names_only_what_is_known(where, expected):
    err = DeepNVMeIOError("boom", **where)
    assert str(err) == expected and "None" not in str(err)
    assert (err.path, err.offset, err.size) == (where["path"], where["offset"], where["size"])
    with_code = DeepNVMeIOError("boom", errno=errno.EIO, **where)
    assert str(with_code) == f"[Errno {errno.EIO}] {expected}" and with_code.errno == errno.EIO
    again = pickle.loads(pickle.dumps(with_code))
    assert str(again) == str(with_code) and again.size == where["size"]


@pytest.mark.parametrize("code,kind,builtin", [
    (errno.ENOENT, FileNotFoundIOError, FileNotFoundError),
    (errno.EACCES, PermissionIOError, PermissionError),
    (errno.EPERM, PermissionIOError, PermissionError),
    (errno.ENOSPC, DeepNVMeIOError, OSError),
])
def test_from_oserror_without_a_transfer(code, kind, builtin):
    err = DeepNVMeIOError.from_oserror(OSError(code, "x"), op="open", path="/d/f", offset=None,
                                       size=None)
    assert type(err) is kind and isinstance(err, builtin) and err.errno == code
    assert str(err).endswith("(file '/d/f')") and "None" not in str(err)


def test_subclasses_keep_their_fields_in_the_message():
    short = ShortTransferError("unexpected end of file", path="f", offset=8, size=16,
                               transferred=4)
    assert str(short).endswith("unexpected end of file: 4 of 16 bytes transferred "
                               "(file 'f', offset 8, size 16)")
    assert "None" not in str(ValidationError("differs", path="f", offset=None, size=None))
