"""The package's imports flow one way: every module imports, and no modules import each other in a circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "keras_sync"


def module_files(package: Path) -> dict[str, Path]:
    """``{"keras_sync.cli.launch": path, ...}`` for every module of `package` (a package is its ``__init__``)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run when the module is imported or its functions are called.

    Skipped: ``if TYPE_CHECKING:`` (never runs) and ``if __name__ == "__main__":`` (runs only when
    the file is the program, as another module object, ``__main__``).
    """
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If):
            text = ast.unparse(node.test)
            if text.endswith("TYPE_CHECKING") or text.replace("'", '"') == '__name__ == "__main__"':
                for child in node.orelse:
                    visit(child)
                return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (anywhere in its file, functions included).

    ``from keras_sync import scaling`` is an edge to ``keras_sync.training.scaling``; ``from keras_sync.x
    import name`` to ``keras_sync.x``. A module's parent packages are not edges unless it names them.
    """
    files = module_files(package)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
                continue
            base = node.module or ""
            if node.level:
                parent = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                edges.add(target if target in files else base)
        graph[name] = {m for m in edges if m in files and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other in a loop (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_modules_import_each_other_in_a_circle() -> None:
    graph = import_graph(PACKAGE)
    shown = [" <-> ".join(g) + ": " + "; ".join(f"{a} -> {', '.join(sorted(graph[a] & set(g)))}" for a in g)
             for g in circles(graph)]
    assert shown == []


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")  # a deferred import still closes it
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "d.py").write_text("import pkg.c\nif __name__ == '__main__':\n    import pkg.d\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.c"] == set() and graph["pkg.d"] == {"pkg.c"}
    assert circles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_every_module_imports() -> None:
    # In a subprocess: the modules of the callbacks import Keras (TensorFlow), kept out of this process.
    names = sorted(module_files(PACKAGE))
    code = f"import importlib\nfor n in {names!r}:\n    importlib.import_module(n)\nprint(len({names!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(len(names))
