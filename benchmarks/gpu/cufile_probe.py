"""Why cuFile accepts or refuses files here: open the driver, register files opened several ways
in several directories, print each result and the end of cufile.log. Diagnostic, no timing.

Usage: python benchmarks/gpu/cufile_probe.py DIR [DIR ...]
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys

import torch


def main() -> int:
    torch.zeros(1, device="cuda")
    from cuda.bindings import cufile
    print("CUFILE_ENV_PATH_JSON =", os.environ.get("CUFILE_ENV_PATH_JSON"))
    try:
        cufile.driver_open()
        print("driver_open: ok")
    except Exception as exc:  # noqa: BLE001 - a diagnostic prints everything
        print("driver_open:", exc)
        return 1
    with contextlib.suppress(Exception):
        print("use count:", cufile.use_count())
    ok = False
    for d in sys.argv[1:]:
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "probe.bin")
        with open(path, "wb") as f:
            f.write(b"\0" * (1 << 20))
        for label, flags in (("O_DIRECT", os.O_RDWR | os.O_DIRECT), ("buffered", os.O_RDWR)):
            try:
                fd = os.open(path, flags)
            except OSError as exc:
                print(f"{d} {label}: open failed {exc}")
                continue
            descr = cufile.Descr()
            descr.type = cufile.FileHandleType.OPAQUE_FD
            descr.handle.fd = fd
            descr.fs_ops = 0
            raw = descr._data.tobytes() if hasattr(descr, "_data") else b""
            try:
                fh = cufile.handle_register(descr.ptr)
                buf = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
                result = cufile.read(fh, buf.data_ptr(), 1 << 20, 0, 0)
                print(f"{d} {label}: registered, read returned {result!r}")
                cufile.handle_deregister(fh)
                ok = True
            except Exception as exc:  # noqa: BLE001
                print(f"{d} {label}: {exc} (descr bytes {raw.hex()}, fd {fd})")
            finally:
                os.close(fd)
        os.unlink(path)
    logs = glob.glob("cufile.log") + glob.glob(os.path.join(os.path.dirname(sys.argv[1]), "cufile.log"))
    for log in logs:
        print(f"--- {log} (last 25 lines)")
        with open(log, errors="replace") as f:
            print("".join(f.readlines()[-25:]))
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
