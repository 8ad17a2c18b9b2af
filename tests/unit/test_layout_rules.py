"""Layout rules for src/deepnvme: no two files import each other, directly or through a longer
circle, and no module is longer than the hard limit.

Imports are read with ``ast`` (nothing is imported): statements at module level (``if
TYPE_CHECKING:`` blocks included) and inside functions, absolute ``deepnvme.`` and relative
ones. ``from pkg import name`` counts as importing the submodule ``pkg/name`` when there is
one, else ``pkg/__init__.py``. Parent packages' ``__init__`` files, which Python runs on the
way, are not counted: every module would otherwise reach the package root.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "deepnvme"
MAX_LINES = 450

Module = tuple[str, ...]  # path parts below src/deepnvme, without ".py" ("__init__" for packages)


def _modules(root: Path) -> dict[Module, Path]:
    found = {}
    for path in root.rglob("*.py"):
        found[path.relative_to(root).with_suffix("").parts] = path
    return found


def _resolve(name: Module, modules: dict[Module, Path]) -> Module | None:
    """The file that importing the dotted module ``name`` (below deepnvme) runs last."""
    if name in modules:
        return name
    if name + ("__init__",) in modules:
        return name + ("__init__",)
    return None


def _targets(node: ast.Import | ast.ImportFrom, package: Module,
             modules: dict[Module, Path]) -> list[Module]:
    """The module files one import statement in a module of ``package`` names."""
    if isinstance(node, ast.Import):
        names = [tuple(a.name.split(".")[1:]) for a in node.names
                 if a.name == "deepnvme" or a.name.startswith("deepnvme.")]
        return [m for m in (_resolve(n, modules) for n in names) if m is not None]
    dotted = tuple(node.module.split(".")) if node.module else ()
    if node.level:
        if node.level - 1 > len(package):
            return []
        mod = package[:len(package) - (node.level - 1)] + dotted
    elif dotted[:1] == ("deepnvme",):
        mod = dotted[1:]
    else:
        return []
    whole = _resolve(mod, modules)
    found: list[Module] = []
    for alias in node.names:
        sub = _resolve(mod + (alias.name,), modules) if alias.name != "*" else None
        target = sub if sub is not None else whole
        if target is not None and target not in found:
            found.append(target)
    return found


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement: at module level (conditional ones included) and in functions."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def import_graph(root: Path = SRC) -> dict[Module, set[Module]]:
    """Each module file -> the module files it imports."""
    modules = _modules(root)
    graph: dict[Module, set[Module]] = {}
    for mod, path in modules.items():
        package = mod[:-1]
        edges: set[Module] = set()
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            edges.update(t for t in _targets(node, package, modules) if t != mod)
        graph[mod] = edges
    return graph


def cycles(graph: dict[Module, set[Module]]) -> list[list[Module]]:
    """The strongly connected components of more than one file (Tarjan, iterative)."""
    index: dict[Module, int] = {}
    low: dict[Module, int] = {}
    stack: list[Module] = []
    on_stack: set[Module] = set()
    found: list[list[Module]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _name(mod: Module) -> str:
    return "/".join(mod) + ".py"


def test_no_file_imports_itself_through_others():
    found = cycles(import_graph())
    assert not found, "import circles between files:\n" + "\n".join(
        "  " + ", ".join(_name(m) for m in c) for c in found)


def test_no_module_over_the_line_limit():
    long = sorted((len(p.read_text().splitlines()), str(p.relative_to(SRC)))
                  for p in SRC.rglob("*.py"))
    over = [f"  {name}: {n} lines" for n, name in long if n > MAX_LINES]
    assert not over, f"modules over {MAX_LINES} lines:\n" + "\n".join(over)


def _graph_of(tmp_path: Path, files: dict[str, str]) -> dict[Module, set[Module]]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(tmp_path)


def test_the_checker_finds_circles_of_every_import_form(tmp_path):
    graph = _graph_of(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/one.py": "from . import two\n",                      # submodule by name
        "a/two.py": "def f():\n    from ..b.three import x\n",  # in a function, two levels
        "b/__init__.py": "from .three import x\n",
        "b/three.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    import deepnvme.a.one\nx = 1\n",
        "c.py": "from deepnvme.b import three\nfrom deepnvme import a\n",
    })
    assert graph[("c",)] == {("b", "three"), ("a", "__init__")}
    assert graph[("b", "__init__")] == {("b", "three")}
    assert cycles(graph) == [[("a", "one"), ("a", "two"), ("b", "three")]]


def test_the_checker_passes_a_tree_without_circles(tmp_path):
    graph = _graph_of(tmp_path, {"__init__.py": "from .a import f\n",
                                 "a.py": "from .b import g\ndef f():\n    from . import b\n",
                                 "b.py": "import os\ng = 1\n"})
    assert graph[("__init__",)] == {("a",)} and cycles(graph) == []
