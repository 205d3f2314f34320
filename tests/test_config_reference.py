"""The commented template and the docs' config reference are written from the config fields, and stay so."""

from __future__ import annotations

import dataclasses
import doctest
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from keras_sync.cli.init import render_config
from keras_sync.config import DOCS, Config, _f, load_config
from keras_sync.config import reference as config_reference
from keras_sync.config.kinds import STRATEGY_KINDS
from keras_sync.config.reference import (
    REFERENCE_BEGIN,
    REFERENCE_END,
    REFERENCE_PAGE,
    drift,
    source_root,
)
from keras_sync.config.specs import integer
from keras_sync.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = [sys.executable, "-m", "keras_sync.config.reference"]


def _leaf_fields(cls: type, path: str = ""):
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        dotted = (
            f"{path}.{f.metadata.get('key') or f.name}"
            if path
            else (f.metadata.get("key") or f.name)
        )
        if f.metadata.get("spec") is None:
            yield from _leaf_fields(f.default_factory, dotted)
        else:
            yield dotted, f


def test_doctests_hold() -> None:
    assert doctest.testmod(config_reference).failed == 0


def test_templates_and_the_docs_reference_match_the_config_fields() -> None:
    stale = drift(source_root())
    assert not stale, (
        "generated files differ from keras_sync/config/__init__.py; run `python -m keras_sync.config.reference`"
        "\n" + "\n".join(stale.values())
    )


def test_every_key_is_documented_in_the_docs_reference_with_its_doc_and_default() -> None:
    page = (ROOT / REFERENCE_PAGE).read_text()
    block = page[page.index(REFERENCE_BEGIN) : page.index(REFERENCE_END)]
    for dotted, f in _leaf_fields(Config):
        row = next(
            (line for line in block.splitlines() if line.startswith(f"| `{dotted}` |")), None
        )
        assert row is not None, f"{REFERENCE_PAGE} has no row for {dotted}"
        assert DOCS[dotted] in row.replace("\\|", "|")
        assert f"`{config_reference.yaml_value(f.default)}`" in row
        kinds = f.metadata.get("kinds")
        if kinds and set(kinds) != set(
            STRATEGY_KINDS
        ):  # said once, before the doc (a section's keys too)
            assert (
                row.count(f"| {', '.join(kinds)}: ") == 1
                and row.count(f"{', '.join(kinds)}: ") == 1
            ), row


@pytest.mark.parametrize("kind", STRATEGY_KINDS)
def test_each_kind_template_shows_the_keys_that_apply_with_their_docs(
    kind: str, tmp_path: Path
) -> None:
    text = render_config(kind, 64)
    data = yaml.safe_load(text)
    for dotted, f in _leaf_fields(Config):
        section, _, rest = dotted.partition(".")
        kinds = f.metadata.get("kinds")
        if section == "strategy" and rest.startswith("tpu."):
            kinds = ("tpu",)
        shown = kinds is None or kind in kinds
        node = data
        for part in dotted.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        # A section the template shows commented out (its defaults change nothing) is not in the data.
        commented = any(
            f2.metadata.get("commented") for f2 in dataclasses.fields(Config) if f2.name == section
        )
        assert (node is not KeyError) == (shown and not commented), (
            f"{dotted} in the {kind} template: expected shown={shown}"
        )
        if shown and dotted != "strategy.kind":
            assert DOCS[dotted] in " ".join(
                line.strip().lstrip("# ") for line in text.splitlines()
            ), dotted
    path = tmp_path / "keras_sync.yaml"
    path.write_text(text)
    assert load_config(path, environ={}).strategy.kind == kind
    assert "\n\n\n" not in text  # one blank line between sections


def _copy_checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "templates", root / "templates")
    (root / REFERENCE_PAGE).parent.mkdir(parents=True)
    shutil.copy(ROOT / REFERENCE_PAGE, root / REFERENCE_PAGE)
    return root


def test_check_fails_on_a_hand_edited_comment_and_regenerating_fixes_it(tmp_path: Path) -> None:
    root = _copy_checkout(tmp_path)
    template = root / "templates" / "strategy_mirrored.yaml"
    template.write_text(template.read_text().replace("how local gradients", "how remote gradients"))
    check = subprocess.run(
        [*REGENERATE, "--check", "--root", str(root)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 1
    assert (
        "-  # how remote gradients" in check.stdout and "+  # how local gradients" in check.stdout
    )
    assert (
        "1 file(s) differ from the config fields: run python -m keras_sync.config.reference"
        in check.stderr
    )
    write = subprocess.run(
        [*REGENERATE, "--root", str(root)], capture_output=True, text=True, timeout=60
    )
    assert write.returncode == 0 and write.stdout.strip() == f"wrote {template}"
    again = subprocess.run(
        [*REGENERATE, "--check", "--root", str(root)], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert template.read_text() == (ROOT / "templates" / "strategy_mirrored.yaml").read_text()


def test_a_reference_page_without_the_markers_is_an_error_naming_them(tmp_path: Path) -> None:
    root = _copy_checkout(tmp_path)
    page = root / REFERENCE_PAGE
    page.write_text(page.read_text().replace(REFERENCE_END, ""))
    result = subprocess.run(
        [*REGENERATE, "--check", "--root", str(root)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert (
        f"{REFERENCE_PAGE} has no generated config reference block: put the lines" in result.stderr
    )
    assert REFERENCE_END in result.stderr


def test_a_key_without_a_doc_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Section:
        undocumented: int = _f(1, integer(0))

    with pytest.raises(
        UsageError,
        match="config key 'x.undocumented' has no doc: give its field in "
        "keras_sync/config/__init__.py a description",
    ):
        config_reference._section_lines(Section, "x", "  ")


def test_every_environment_variable_that_sets_a_key_is_named_where_precedence_is_told() -> None:
    # ENV_KEYS is the one list of environment variables that set a config key. The key's own description
    # (the docs' reference row, template comment, errors), the template's header and the docs' precedence
    # sentence are written by hand around it: a variable added to ENV_KEYS fails here until all say so.
    import re

    from keras_sync.config import ENV_KEYS
    from keras_sync.config.reference import config_template

    page = (ROOT / REFERENCE_PAGE).read_text()
    precedence = re.search(
        r"^Precedence, shown by `keras-sync plan`:(.*?)> YAML file > default\.", page, re.S | re.M
    )
    assert precedence, (
        f"{REFERENCE_PAGE} lost its 'Precedence, shown by `keras-sync plan`: ...' sentence"
    )
    header = next(
        line for line in config_template().splitlines() if line.startswith("# Precedence:")
    )
    for variable, key in ENV_KEYS.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{key}` |"))
        assert f"${variable}" in row, f"{key}'s description does not say ${variable} sets it: {row}"
        assert f"`{variable}`" in precedence.group(1), (
            f"{REFERENCE_PAGE}'s precedence sentence does not name {variable}"
        )
        assert variable in header, (
            f"the template's precedence line does not name {variable}: {header}"
        )
