"""Count import arrows between deepnvme's top-level modules and packages (issue 13's before/after).

Usage: python tools/import_arrows.py [SRC_DIR]   (default: src/deepnvme)
Prints one line per arrow ``from -> to: count``, counting relative and absolute imports.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path


def _top(parts: tuple[str, ...]) -> str:
    return parts[0].removesuffix(".py") if parts else "__init__"


def arrows(root: Path) -> Counter[tuple[str, str]]:
    """(importing top-level unit, imported top-level unit) -> number of import statements."""
    found: Counter[tuple[str, str]] = Counter()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).parts
        here = _top(rel)
        package = list(rel[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[list[str]] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                    mod = base + (node.module.split(".") if node.module else [])
                    targets = [mod] if node.module else [base + [a.name] for a in node.names]
                elif node.module and node.module.startswith("deepnvme."):
                    targets = [node.module.split(".")[1:]]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".")[1:] for a in node.names if a.name.startswith("deepnvme.")]
            for mod in targets:
                there = mod[0] if mod else "__init__"
                if there != here:
                    found[(here, there)] += 1
    return found


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "src/deepnvme")
    for (a, b), n in sorted(arrows(root).items()):
        print(f"{a} -> {b}: {n}")


if __name__ == "__main__":
    main()
