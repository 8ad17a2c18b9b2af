"""``deepspeed.ops`` stand-in: ``__compatible_ops__`` from deepnvme's builders."""

from __future__ import annotations

from . import op_builder

__compatible_ops__: dict[str, bool] = {
    builder.NAME: builder().is_compatible()
    for builder in (op_builder.AsyncIOBuilder, op_builder.GDSBuilder, op_builder.PinMemoryBuilder,
                    op_builder.UtilsBuilder)
}

__all__ = ["__compatible_ops__", "op_builder"]
