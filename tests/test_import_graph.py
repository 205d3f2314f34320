"""The package's imports flow one way: every module imports, no modules import each other in a circle,
and each part of the package imports only the parts below it (`LAYERS`)."""

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
    """Every import statement that can run when the module is imported, its functions are called,
    or it runs as a program (``if __name__ == "__main__":`` counts). Skipped: ``if TYPE_CHECKING:``
    (never runs).
    """
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If):
            text = ast.unparse(node.test)
            if text.endswith("TYPE_CHECKING"):
                for child in node.orelse:
                    visit(child)
                return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(package: Path, skip_names: set[str] = frozenset()) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (anywhere in its file, functions included).

    ``from keras_sync import errors`` is an edge to ``keras_sync.errors``; ``from keras_sync.x
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
                if alias.name in skip_names:
                    continue
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
    shown = [
        " <-> ".join(g)
        + ": "
        + "; ".join(f"{a} -> {', '.join(sorted(graph[a] & set(g)))}" for a in g)
        for g in circles(graph)
    ]
    assert shown == []


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "def f():\n    from ..a import g\n"
    )  # a deferred import still closes it
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    (pkg / "d.py").write_text("import pkg.c\nif __name__ == '__main__':\n    import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.c"] == set() and graph["pkg.d"] == {"pkg.c", "pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.sub.b"]]


#: The parts of keras_sync (a subpackage or a module at the top), lowest first. A module may import
#: its own part and the parts of lower rows, never a part of its own row or of a higher one: the
#: data flows YAML -> config -> strategy/cluster -> training -> callbacks -> tracking, and `Sync`
#: (session) puts them together. "" is the package itself (`keras_sync/__init__.py`, the public API).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),  # the one base class of every error
    ("upstream", "measures"),  # Keras/TF internals behind probes; the pure maths of the metrics
    ("cluster",),  # where this process sits, its peers, preemption
    ("config",),  # YAML -> frozen Config; every value a user may write
    ("strategy", "tracking"),  # the factory; the writer, the spool protocol and its delivery
    ("training",),  # what Sync.fit runs on
    ("callbacks",),  # the public Keras callbacks
    ("session", "launch"),  # Sync and load(); the local launcher
    ("cli",),  # the command line
    ("", "__main__"),  # the public API; `python -m keras_sync` and `python -m keras_sync.launch`
)


def part_of(module: str) -> str:
    """``keras_sync.tracking.spool`` -> ``tracking``; ``keras_sync`` -> ``""``; every
    ``....__main__`` (an entry point of ``python -m``) -> ``__main__``."""
    if module.endswith(".__main__"):
        return "__main__"
    return module.split(".")[1] if "." in module else ""


def layer_breaches(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import of a part from the same row or a higher one, as ``"a -> b (part a, row i -> part b, row j)"``.

    ``from keras_sync import __version__`` is no breach: Python runs the package's ``__init__``
    before any of its modules in any case.
    """
    rank = {p: i for i, row in enumerate(layers) for p in row}
    found = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            pa, pb = part_of(a), part_of(b)
            if pa not in rank or pb not in rank:
                found.append(
                    f"{a} -> {b}: a part missing from LAYERS ({pa if pa not in rank else pb!r})"
                )
            elif pa != pb and rank[pb] >= rank[pa]:
                found.append(
                    f"{a} -> {b} ({pa or 'keras_sync'}, row {rank[pa]} -> {pb or 'keras_sync'}, row {rank[pb]})"
                )
    return found


def test_each_part_imports_only_the_parts_below_it() -> None:
    assert layer_breaches(import_graph(PACKAGE, skip_names={"__version__"})) == []


def test_every_part_is_in_the_layers() -> None:
    parts = {part_of(m) for m in module_files(PACKAGE)}
    assert parts == {p for row in LAYERS for p in row}


def test_a_private_module_is_imported_only_inside_its_part() -> None:
    graph = import_graph(PACKAGE)
    outside = [
        f"{a} -> {b}"
        for a in sorted(graph)
        for b in sorted(graph[a])
        if b.rpartition(".")[2].startswith("_") and part_of(a) != part_of(b)
    ]
    assert outside == []


def test_the_layer_check_finds_an_import_upwards(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("__version__ = '1'\n")
    (pkg / "high" / "a.py").write_text("from pkg.low import b\n")
    (pkg / "low" / "b.py").write_text(
        "from pkg import __version__\ndef f():\n    from pkg.high.a import g\n"
    )
    (pkg / "low" / "c.py").write_text("from pkg.low import b\n")  # its own part: allowed
    layers = (("low",), ("high",), ("",))
    graph = import_graph(pkg, skip_names={"__version__"})
    assert layer_breaches(graph, layers) == ["pkg.low.b -> pkg.high.a (low, row 0 -> high, row 1)"]
    assert (
        "pkg" in import_graph(pkg)["pkg.low.b"]
    )  # without skip_names the version import is an edge


def test_every_module_imports() -> None:
    # In a subprocess: the modules of the callbacks import Keras (TensorFlow), kept out of this process.
    names = sorted(module_files(PACKAGE))
    code = f"import importlib\nfor n in {names!r}:\n    importlib.import_module(n)\nprint(len({names!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(len(names))


#: Modules of Keras, TensorFlow and MLflow that are not their public API; only `keras_sync.upstream`
#: imports them, each behind a probe (`keras_sync.upstream.internals`).
PRIVATE_PREFIXES = (
    "keras.src",
    "tensorflow.python",
    "tensorflow.compiler",
    "mlflow.store",
    "mlflow.utils",
)


def private_imports(package: Path) -> list[str]:
    """``"keras_sync/x.py:12 keras.src.foo"`` for every private import outside ``upstream/``
    (imports inside functions included; ``mlflow.tracking._*`` counts as private)."""

    def private(name: str) -> bool:
        return name.startswith(tuple(p + "." for p in PRIVATE_PREFIXES)) or (
            name in PRIVATE_PREFIXES or name.startswith("mlflow.tracking._")
        )

    found = []
    for name, path in module_files(package).items():
        if name.split(".")[1:2] == ["upstream"]:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for imported in names:
                if private(imported):
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {imported}")
                    break
    return found


def test_only_upstream_imports_private_keras_tensorflow_or_mlflow_modules() -> None:
    found = private_imports(PACKAGE)
    assert found == [], "private modules imported outside keras_sync/upstream/:\n" + "\n".join(
        found
    )


def test_the_private_import_check_finds_one_in_a_function(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "upstream").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "upstream" / "__init__.py").write_text("import keras.src.trainers\n")  # allowed there
    (pkg / "a.py").write_text("def f():\n    from tensorflow.python.eager import context\n")
    (pkg / "b.py").write_text("from mlflow.tracking import _tracking_service\nimport keras\n")
    (pkg / "c.py").write_text(
        "import mlflow.store.db.utils as u\nfrom mlflow import MlflowClient\n"
    )
    assert private_imports(pkg) == [
        "pkg/a.py:2 tensorflow.python.eager",
        "pkg/b.py:1 mlflow.tracking._tracking_service",
        "pkg/c.py:1 mlflow.store.db.utils",
    ]
