"""Stand-in ``deepspeed`` package for running DeepSpeed's op tests against deepnvme.

Only what DeepSpeed's aio/gds/pin-memory unit tests import is provided here, mapped onto
``deepnvme.compat`` and torch. Submodules not defined here (``deepspeed.io`` for the
FastFileWriter tests) come unchanged from the DeepSpeed source tree named by the environment
variable ``DEEPNVME_DEEPSPEED_SRC`` (set by tools/run_deepspeed_op_tests.py).
"""

from __future__ import annotations

import os

__version__ = "0.0.0+deepnvme-shim"

_src = os.environ.get("DEEPNVME_DEEPSPEED_SRC")
if _src:
    __path__.append(os.path.join(_src, "deepspeed"))  # the package's own __path__

from . import accelerator, comm, ops

__all__ = ["accelerator", "comm", "ops"]
