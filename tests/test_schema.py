"""`keras-sync schema`: a valid JSON Schema that accepts what the loader accepts and rejects what it rejects."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from keras_sync.cli.init import render_config
from keras_sync.config import load_config
from keras_sync.config.kinds import STRATEGY_KINDS
from keras_sync.config.reference import config_schema
from keras_sync.errors import ConfigError

try:
    import jsonschema
except ImportError:  # pragma: no cover - an old venv
    raise ImportError(
        "tests/test_schema.py needs jsonschema, in the test extra: pip install -e '.[test]'"
    ) from None

KERAS_SYNC = str(Path(sys.executable).with_name("keras-sync"))
BAD_CONFIGS = Path(__file__).parent / "fixtures" / "bad_configs"
# What only the loader can see: rules between keys (one of per_replica / global), duplicate keys
# (a YAML reader keeps the last), bad YAML, tags, an empty file. The schema checks each key alone.
LOADER_ONLY = {"conflicting_keys", "duplicate_key", "yaml_syntax", "python_tag", "empty"}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    result = subprocess.run([KERAS_SYNC, "schema"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema)


def _errors(validator: jsonschema.Draft202012Validator, data: Any) -> list[str]:
    return sorted(
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(data)
    )


def test_schema_is_a_valid_draft_2020_12_schema(schema: dict[str, Any]) -> None:
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_cli_prints_the_python_api_schema(schema: dict[str, Any]) -> None:
    assert schema == json.loads(json.dumps(config_schema()))


def test_kind_enum_default_and_description_come_from_the_field(schema: dict[str, Any]) -> None:
    kind = schema["properties"]["strategy"]["properties"]["kind"]
    assert (kind["enum"], kind["default"]) == (list(STRATEGY_KINDS), "auto")
    assert kind["description"].startswith("which strategy")
    devices = schema["properties"]["strategy"]["properties"]["devices"]
    assert devices["description"].startswith("one_device, mirrored: ")  # the kinds a key applies to


def test_default_config_is_valid(validator: jsonschema.Draft202012Validator) -> None:
    assert _errors(validator, load_config({}, environ={}).to_dict()) == []


@pytest.mark.parametrize("kind", STRATEGY_KINDS)
def test_every_template_is_valid(validator: jsonschema.Draft202012Validator, kind: str) -> None:
    assert _errors(validator, yaml.safe_load(render_config(kind, 64))) == []


@pytest.mark.parametrize(
    "text",
    [
        "batch: {shard_policy: off}",
        "batch: {drop_remainder: false}",
        "fault_tolerance: {save_freq: 100}",
        "strategy: {devices: ['/cpu:0']}",
        "learning_rate: {warmup_epochs: 0.5}",
        "mlflow: null",
    ],
)
def test_values_the_loader_accepts_are_valid(
    validator: jsonschema.Draft202012Validator, text: str
) -> None:
    data = yaml.safe_load(text)
    load_config(data, environ={})
    assert _errors(validator, data) == []


@pytest.mark.parametrize("name", sorted(p.stem for p in BAD_CONFIGS.glob("*.yaml")))
def test_bad_fixtures_are_rejected_by_the_loader_and_by_the_schema_where_it_can_see(
    validator: jsonschema.Draft202012Validator, name: str
) -> None:
    path = BAD_CONFIGS / f"{name}.yaml"
    with pytest.raises(ConfigError):
        load_config(path, environ={})
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        assert name in LOADER_ONLY  # no YAML data for an editor to check
        return
    if name in LOADER_ONLY:
        assert data is None or _errors(validator, data) == [], (
            "the schema now sees it: move it out of LOADER_ONLY"
        )
    else:
        assert _errors(validator, data) != []


def test_each_bad_key_is_one_schema_error(validator: jsonschema.Draft202012Validator) -> None:
    errors = _errors(
        validator,
        {
            "strategy": {"kind": "gpu", "simulated_cpu_replicas": "two"},
            "batch": {"per_replca": 64},
            "learning_rate": {"base": 0},
        },
    )
    assert len(errors) == 4, errors
    assert any(
        e.startswith("batch: Additional properties are not allowed ('per_replca'") for e in errors
    )
    assert any(e.startswith("strategy.kind: 'gpu' is not one of") for e in errors)
