"""Every module the docs name exists: README.md, CONTRIBUTING.md, the pages of docs/ and the package's own docstrings and
comments name files (`keras_sync/tracking/spool.py`) and modules (`keras_sync.training.instrument`),
and a move of modules leaves the old names behind without a test failing unless these fail.

Read from the source, without importing it (no TensorFlow)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "keras_sync"
DOCS = (
    "README.md",
    "CONTRIBUTING.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")),
)

# Files of other projects that docstrings cite (Keras sources read to explain a fix): not ours to check.
UPSTREAM_FILES = {"py_dataset_adapter.py", "epoch_iterator.py"}


def _package_prose() -> dict[str, str]:
    """Each package module's docstrings, other string constants and comments: where it names modules in words."""
    prose = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        parts = [
            node.value
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        ]
        parts += [
            tok.string
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT
        ]
        prose[str(path.relative_to(ROOT))] = "\n".join(parts)
    return prose


def _texts() -> dict[str, str]:
    return {**{name: (ROOT / name).read_text() for name in DOCS}, **_package_prose()}


def _top_level_names(module_file: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if module_file.name == "__init__.py":
        names |= {p.stem for p in module_file.parent.glob("*.py")} | {
            p.parent.name for p in module_file.parent.glob("*/__init__.py")
        }
        lazy = re.search(r"^_LAZY = \{(.*?)^\}", module_file.read_text(), flags=re.S | re.M)
        if lazy:
            names |= set(re.findall(r'"(\w+)":', lazy.group(1)))
    return names


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _string_literals_of_the_package(pattern: str = r"^keras_sync\.[\w.]+") -> set[str]:
    """Names the code writes as data: MLflow tags and params (`keras_sync.job_id`), artifact paths."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= set(re.findall(pattern, node.value))
    return found


def unresolved_dotted_name(name: str, data_names: set[str]) -> str | None:
    """Why `name` (``keras_sync.a.b``) names nothing in the package, or None when it does.

    The longest prefix that is a module must be followed by at most one part, a name defined at its top level
    (a function, class, constant, submodule or lazy export). A name the code writes as data (an MLflow tag
    ``keras_sync.job_id``, ``keras_sync.check.<name>``), a file (``keras_sync.yaml``) or the shipped
    ``keras_sync.templates`` passes.
    """
    if name in {"keras_sync.yaml", "keras_sync.templates"} or name.startswith("keras_sync.schema"):
        return None
    if any(
        name == d or name.startswith(d.rstrip(".") + ".") or d.startswith(name + ".")
        for d in data_names
    ):
        return None
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(parts[:cut])
        if module is not None:
            break
    rest = parts[cut:]
    if not rest:
        return None
    if rest[0] not in _top_level_names(module):
        return f"{'.'.join(parts[:cut])} ({module.relative_to(ROOT)}) has no {rest[0]!r}"
    return None


def test_every_keras_sync_file_path_in_the_docs_exists():
    artifacts = _string_literals_of_the_package(
        r"^keras_sync/[\w/.]+$"
    )  # MLflow artifact paths, e.g. keras_sync/config.yaml
    missing = []
    for where, text in _texts().items():
        for path in set(
            re.findall(
                r"\b((?:keras_sync|tests|templates|benchmarks|examples)/[\w/]+\.(?:py|yaml))\b",
                text,
            )
        ):
            if not (ROOT / path).exists() and path not in artifacts:
                missing.append(f"{where}: {path}")
    assert not missing, "the docs name files that do not exist (moved? renamed?):\n" + "\n".join(
        sorted(missing)
    )


def test_every_path_inside_a_part_in_the_docs_exists():
    """`callbacks/sync_metrics.py`, `cli/plan.py`: a path that starts at one of the package's parts (paths into
    TensorFlow, Keras or Ray sources, which docstrings cite, start elsewhere)."""
    parts = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    missing = []
    for where, text in _texts().items():
        for path in set(re.findall(r"(?<![\w/.])((?:\w+/)+\w+\.py)\b", text)):
            if path.split("/")[0] in parts and not (PACKAGE / path).exists():
                missing.append(f"{where}: {path}")
    assert not missing, (
        "the docs name files of a part that do not exist (moved? renamed?):\n"
        + "\n".join(sorted(missing))
    )


def test_every_dotted_keras_sync_name_in_the_docs_exists():
    # Only literals that are no module: "keras_sync.tracking" (a module the code names in a string) must not
    # let every `keras_sync.tracking.<anything>` pass.
    data_names = {
        d
        for d in _string_literals_of_the_package()
        if _module_file(d.rstrip(".").split(".")) is None
    }
    bad = []
    for where, text in _texts().items():
        for name in sorted(set(re.findall(r"\bkeras_sync(?:\.\w+)+", text))):
            name = name.rstrip(".")
            why = unresolved_dotted_name(name, data_names)
            if why:
                bad.append(f"{where}: {name}: {why}")
    assert not bad, (
        "the docs name modules or names that do not exist (moved? renamed?):\n" + "\n".join(bad)
    )


def test_every_bare_module_file_name_in_the_docs_exists():
    """`config.py`, `_spool.py`: a file name alone must still be the name of one of the repository's files."""
    ours = {
        p.name
        for d in ("keras_sync", "tests", "templates", "benchmarks", "examples", "docs")
        for p in (ROOT / d).rglob("*.py")
    } | {p.name for p in ROOT.glob("*.py")}
    missing = []
    for where, text in _texts().items():
        for name in set(re.findall(r"(?<![\w/.*])(\w+\.py)\b", text)):
            if name not in ours and name not in UPSTREAM_FILES:
                missing.append(f"{where}: {name}")
    assert not missing, (
        "the docs name module files that no longer exist (say the new path, e.g. "
        "keras_sync/config/__init__.py):\n" + "\n".join(sorted(missing))
    )


def test_private_aliases_are_not_used_as_module_names_in_prose():
    """Since the move, `_instrument` is only an import alias of `keras_sync.training.instrument`: a reader who
    looks for `_instrument.py` finds nothing. Docstrings and comments name the module (``instrument``)."""
    modules = {p.stem for p in PACKAGE.rglob("*.py")}
    bad = []
    for where, text in _package_prose().items():
        for alias in set(re.findall(r"`_(\w+)[.`]", text)):
            if alias in modules and not any(PACKAGE.rglob(f"_{alias}.py")):
                bad.append(f"{where}: _{alias}")
    assert not bad, "docstrings name modules by their private import alias:\n" + "\n".join(
        sorted(bad)
    )
