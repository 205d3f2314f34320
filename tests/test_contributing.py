"""CONTRIBUTING.md's recipes name files and functions that exist (they are checked against the code)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "CONTRIBUTING.md").read_text()


def _paths() -> list[str]:
    found = re.findall(
        r"`((?:keras_sync|tests|templates|benchmarks)/[\w/.]+\.(?:py|yaml|md))`", TEXT
    )
    return sorted(set(found))


def test_recipes_name_at_least_the_modules_they_touch() -> None:
    for path in (
        "keras_sync/config/__init__.py",
        "keras_sync/config/kinds.py",
        "keras_sync/strategy/__init__.py",
        "keras_sync/cli/__init__.py",
    ):
        assert f"`{path}`" in TEXT


@pytest.mark.parametrize("path", _paths())
def test_every_named_file_exists(path: str) -> None:
    assert (ROOT / path).exists(), path


@pytest.mark.parametrize(
    "module, name",
    [
        ("keras_sync.config", "_check_consistency"),
        ("keras_sync.config", "_f"),
        ("keras_sync.config.kinds", "KindSpec"),
        ("keras_sync.strategy", "detect"),
        ("keras_sync.strategy", "device_layout"),
        ("keras_sync.cluster", "role"),
        ("keras_sync.config.reference", "main"),
        ("keras_sync.cli._base", "UserError"),
        ("keras_sync.cli.plan", "PlanItem"),
        ("keras_sync.training.context", "SharedState"),
        ("keras_sync.training.context", "RunContext"),
    ],
)
def test_every_named_function_exists(module: str, name: str) -> None:
    assert f"{name}" in TEXT
    assert hasattr(importlib.import_module(module), name)


def test_kindspec_fields_in_the_recipe_are_the_real_ones() -> None:
    import dataclasses

    from keras_sync.config.kinds import KindSpec

    listed = re.search(r"KindSpec\(name, summary, (.*?)\)", TEXT, re.S).group(1)
    named = {
        part.split("=")[0].strip() for part in listed.replace("\n", " ").split(",") if "=" in part
    }
    assert named == {f.name for f in dataclasses.fields(KindSpec)} - {"name", "summary"}


def test_value_specs_named_in_the_config_key_recipe_exist() -> None:
    from keras_sync.config import specs as _fields

    listed = re.search(r"\(`keras_sync/config/specs\.py`: (.*?)\) validates", TEXT, re.S)
    assert listed, (
        "the config-key recipe no longer lists the value specs of keras_sync/config/specs.py"
    )
    names = re.findall(r"`(\w+)`", listed.group(1))
    assert len(names) >= 5, names
    specs = {n: getattr(_fields, n, None) for n in names}
    missing = [n for n, s in specs.items() if not (callable(s) or isinstance(s, _fields.Spec))]
    assert not missing, (
        f"CONTRIBUTING names value specs that keras_sync/config/specs.py does not have: {missing}"
    )


def test_layout_table_rows_are_the_import_layers_top_down() -> None:
    # The table a newcomer reads first and `LAYERS`, the rule test_import_graph.py enforces, name the same parts
    # in the same order: a part added, moved or renamed in one fails here until the other says so.
    from test_import_graph import LAYERS

    table = TEXT[TEXT.index("| part | what it holds | imports |") :].split("\n\n")[0]
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    parts = [
        {
            re.sub(r"^keras_sync/__init__\.py$", "", name).removesuffix("/").removesuffix(".py")
            for name in re.findall(r"`([^`]+)`", row)
        }
        for row in rows
    ]
    assert parts == [set(layer) for layer in reversed(LAYERS)], (
        f"CONTRIBUTING layout rows {parts} vs LAYERS {LAYERS}"
    )
