"""The JSON Schema of ``keras_sync.yaml`` (``keras-sync schema``), from the config dataclasses.

Editors use it to complete and check the file. Every property carries the key's description,
default and allowed values; unknown keys are rejected, as `keras_sync.config.load_config` does.
"""

from __future__ import annotations

from typing import Any

from keras_sync import __version__
from keras_sync.config import Config, _public_fields, _yaml_key
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


def _object_schema(cls: type, path: str) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for f in _public_fields(cls):
        key = _yaml_key(f)
        dotted = f"{path}.{key}" if path else key
        spec = f.metadata.get("spec")
        if spec is None:  # a nested section: its class is the default factory
            sub = _object_schema(f.default_factory, dotted)  # type: ignore[arg-type]
            properties[key] = {**sub, "description": f.metadata.get("doc") or sub["description"]}
        else:
            properties[key] = {
                **spec.json_schema(),
                "description": f"{describe_key(f, dotted)} ({spec.describe()})",
                "default": list(f.default) if isinstance(f.default, tuple) else f.default,
            }
    doc = (cls.__doc__ or "").strip()
    return {
        "type": ["object", "null"] if cls is not Config else "object",
        "description": doc.splitlines()[0] if doc else "",
        "properties": properties,
        "additionalProperties": False,
    }
