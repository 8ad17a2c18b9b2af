"""DeepSpeed-compatible entry point: ``from deepnvme.handles.deepspeed import AsyncIOBuilder`` in place of
``from deepspeed.ops.op_builder import AsyncIOBuilder``. The shapes live in
:mod:`deepnvme.handles.deepspeed`; this public path stays stable."""

from .handles.deepspeed import AsyncIOBuilder, GDSBuilder, PinHandle, PinMemoryBuilder, UtilsBuilder

__all__ = ["AsyncIOBuilder", "GDSBuilder", "PinHandle", "PinMemoryBuilder", "UtilsBuilder"]
