"""Every example in a docstring of keras_sync holds: each module with a ``>>>`` is run through doctest.

Found by reading the source, so a new module's examples are checked without being listed anywhere
(before, a few modules were listed by hand and the rest, `cluster` among them, were never run).
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "keras_sync"
MODULES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in PACKAGE.rglob("*.py")
    if ">>>" in p.read_text()
)


def test_the_package_has_examples() -> None:
    assert "keras_sync.cluster" in MODULES and "keras_sync.training.scaling" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} examples failed in {name} (run: python -m doctest -v)"
    )
