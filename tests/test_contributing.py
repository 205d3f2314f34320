"""CONTRIBUTING.md's recipes name files and functions that exist (they are checked against the code)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "CONTRIBUTING.md").read_text()


def _paths() -> list[str]:
    found = re.findall(r"`((?:keras_sync|tests|templates|benchmarks)/[\w/.]+\.(?:py|yaml|md))`", TEXT)
    return sorted(set(found))


def test_recipes_name_at_least_the_modules_they_touch() -> None:
    for path in ("keras_sync/config.py", "keras_sync/kinds.py", "keras_sync/strategy.py", "keras_sync/cli/__init__.py"):
        assert f"`{path}`" in TEXT


@pytest.mark.parametrize("path", _paths())
def test_every_named_file_exists(path: str) -> None:
    assert (ROOT / path).exists(), path


@pytest.mark.parametrize("module, name", [
    ("keras_sync.config", "_check_consistency"), ("keras_sync.config", "_f"), ("keras_sync.kinds", "KindSpec"),
    ("keras_sync.strategy", "detect"), ("keras_sync.strategy", "device_layout"), ("keras_sync.cluster", "role"),
    ("keras_sync.config_reference", "main"), ("keras_sync.cli._base", "UserError"), ("keras_sync.plan", "PlanItem"),
    ("keras_sync.callbacks._context", "SharedState"), ("keras_sync.callbacks._context", "RunContext"),
])
def test_every_named_function_exists(module: str, name: str) -> None:
    assert f"{name}" in TEXT
    assert hasattr(importlib.import_module(module), name)


def test_kindspec_fields_in_the_recipe_are_the_real_ones() -> None:
    import dataclasses

    from keras_sync.kinds import KindSpec

    listed = re.search(r"KindSpec\(name, summary, (.*?)\)", TEXT, re.S).group(1)
    named = {part.split("=")[0].strip() for part in listed.replace("\n", " ").split(",") if "=" in part}
    assert named == {f.name for f in dataclasses.fields(KindSpec)} - {"name", "summary"}


def test_value_specs_named_in_the_config_key_recipe_exist() -> None:
    from keras_sync import _fields

    listed = re.search(r"\(`keras_sync/_fields\.py`: (.*?)\) validates", TEXT, re.S)
    assert listed, "the config-key recipe no longer lists the value specs of keras_sync/_fields.py"
    names = re.findall(r"`(\w+)`", listed.group(1))
    assert len(names) >= 5, names
    missing = [n for n in names if not isinstance(getattr(_fields, n, None), type)]
    assert not missing, f"CONTRIBUTING names value specs that keras_sync/_fields.py does not have: {missing}"
