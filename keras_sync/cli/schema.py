from __future__ import annotations

import json

import click


@click.command("schema")
def command() -> None:
    """Print the JSON Schema (draft 2020-12) of keras_sync.yaml.

    \b
    Save it and point your editor at it, e.g. for VS Code's YAML extension:
      keras-sync schema > keras_sync.schema.json
      # first line of keras_sync.yaml:
      # yaml-language-server: $schema=keras_sync.schema.json
    """
    from keras_sync.config.reference import config_schema

    click.echo(json.dumps(config_schema(), indent=2))
