"""`keras-sync schema`: the JSON Schema accepts every valid config we ship and rejects bad ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from keras_sync.config import STRATEGY_KINDS, load_config
from keras_sync.scaffold import render_config
from keras_sync.schema import config_schema

KERAS_SYNC = str(Path(sys.executable).with_name("keras-sync"))

_TYPES = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float),
          "boolean": bool, "null": type(None)}


def _type_ok(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[name])


def schema_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """A minimal draft 2020-12 checker for the keywords our schema uses (jsonschema is not installed)."""
    errors: list[str] = []
    if "anyOf" in schema:
        if all(schema_errors(s, value, path) for s in schema["anyOf"]):
            errors.append(f"{path}: {value!r} matches none of anyOf")
        return errors
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {value!r} != {schema['const']!r}")
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_type_ok(value, n) for n in names):
            return [f"{path}: {value!r} is not {names}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and isinstance(value, (int, float)) and value < schema["minimum"]:
        errors.append(f"{path}: {value!r} < {schema['minimum']}")
    if "exclusiveMinimum" in schema and isinstance(value, (int, float)) and value <= schema["exclusiveMinimum"]:
        errors.append(f"{path}: {value!r} <= {schema['exclusiveMinimum']}")
    if "minLength" in schema and isinstance(value, str) and len(value) < schema["minLength"]:
        errors.append(f"{path}: {value!r} too short")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(schema["items"], item, f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key, item in value.items():
            if key in props:
                errors += schema_errors(props[key], item, f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unknown key {key!r}")
    return errors


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    result = subprocess.run([KERAS_SYNC, "schema"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_schema_is_draft_2020_12_and_closed(schema: dict[str, Any]) -> None:
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {"strategy", "batch", "learning_rate", "mlflow", "fault_tolerance"}
    for section in schema["properties"].values():
        assert section["additionalProperties"] is False
        assert section["description"]


def test_schema_has_enums_descriptions_and_defaults(schema: dict[str, Any]) -> None:
    kind = schema["properties"]["strategy"]["properties"]["kind"]
    assert kind["enum"] == list(STRATEGY_KINDS)
    assert kind["default"] == "auto"
    assert kind["description"].startswith("which strategy")
    batch = schema["properties"]["batch"]["properties"]
    assert "global" in batch and "global_" not in batch
    assert batch["per_replica"]["default"] == 32
    assert schema["properties"]["strategy"]["properties"]["tpu"]["properties"]["name"]["default"] == "local"


def test_schema_matches_python_api(schema: dict[str, Any]) -> None:
    assert schema == json.loads(json.dumps(config_schema()))


def test_schema_accepts_default_config(schema: dict[str, Any]) -> None:
    assert schema_errors(schema, load_config({}).to_dict()) == []


@pytest.mark.parametrize("kind", STRATEGY_KINDS)
def test_schema_and_loader_accept_every_template(schema: dict[str, Any], kind: str, tmp_path: Path) -> None:
    text = render_config(kind, 64)
    assert schema_errors(schema, yaml.safe_load(text)) == []
    path = tmp_path / "keras_sync.yaml"
    path.write_text(text)
    cfg = load_config(path, environ={})
    assert (cfg.strategy.kind, cfg.batch.per_replica) == (kind, 64)
    assert text.count("#") >= 10  # commented, line by line


def test_schema_rejects_unknown_key_bad_enum_and_wrong_type(schema: dict[str, Any]) -> None:
    errors = schema_errors(schema, {"strategy": {"kind": "gpu", "simulated_cpu_replicas": "two"},
                                    "batch": {"per_replca": 64}, "learning_rate": {"base": 0}})
    assert len(errors) == 4, errors
