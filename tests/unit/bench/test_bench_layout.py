"""The floors of deepnvme.bench and deepnvme.cli: bench never imports the command line (type-only
imports count too), and their modules stay short. Circles between files are the whole tree's
layout test's."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src" / "deepnvme"


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every deepnvme module ``path`` imports (``from .x import y`` counts x and x.y)."""
    package = _module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + (node.module.split(".") if node.module else []))
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("deepnvme")}


def test_bench_never_imports_the_command_line() -> None:
    for path in (SRC / "bench").glob("*.py"):
        assert not {m for m in _imports(path) if m.startswith("deepnvme.cli")}, path.name


def test_modules_stay_short() -> None:
    for path in [p for d in ("bench", "cli") for p in (SRC / d).glob("*.py")]:
        assert len(path.read_text().splitlines()) <= 400, path.name
