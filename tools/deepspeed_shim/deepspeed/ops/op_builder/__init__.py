"""``deepspeed.ops.op_builder`` stand-in: deepnvme's builders under DeepSpeed's names."""

from deepnvme.compat import AsyncIOBuilder, GDSBuilder, PinMemoryBuilder, UtilsBuilder

__all__ = ["AsyncIOBuilder", "GDSBuilder", "PinMemoryBuilder", "UtilsBuilder"]
