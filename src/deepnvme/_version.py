"""deepnvme's version: the one place it is written (pyproject.toml and ``--version`` read it)."""

__version__ = "0.1.0"
