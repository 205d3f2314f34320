"""The JSON Schema of ``keras_sync.yaml``, generated from the config dataclasses.

Editors (VS Code YAML, PyCharm) use it to complete and check the file: point them at the
output of ``keras-sync schema``. Every property carries the field's description, default
and allowed values; unknown keys are rejected (``additionalProperties: false``), as
`keras_sync.config.load_config` does.

Pure Python: imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from keras_sync import __version__
from keras_sync.config import Config
from keras_sync.config.reference import describe_key

DRAFT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_ID = f"https://keras-sync.invalid/schema/{__version__}/keras_sync.schema.json"


def config_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a keras-sync config file.

    Example:
        >>> schema = config_schema()
        >>> schema["properties"]["strategy"]["properties"]["kind"]["enum"][:2]
        ['auto', 'default']
        >>> schema["additionalProperties"]
        False
    """
    schema = {"$schema": DRAFT, "$id": SCHEMA_ID, "title": "keras-sync config (keras_sync.yaml)"}
    schema.update(_object_schema(Config, ""))
    return schema


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if text and text.strip() else ""


def _object_schema(cls: type, path: str) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        key = f.metadata.get("key") or f.name
        dotted = f"{path}.{key}" if path else key
        spec = f.metadata.get("spec")
        if spec is None:  # a nested section: its class is the default factory
            sub = _object_schema(f.default_factory, dotted)  # type: ignore[arg-type]
            sub["description"] = f.metadata.get("doc") or sub.get("description", "")
            properties[key] = sub
            continue
        prop = dict(spec.json_schema())
        prop["description"] = f"{describe_key(f, dotted)} ({spec.describe()})"
        prop["default"] = _json_value(f.default)
        properties[key] = prop
    return {
        "type": ["object", "null"] if cls is not Config else "object",
        "description": _first_line(cls.__doc__),
        "properties": properties,
        "additionalProperties": False,
    }


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value
