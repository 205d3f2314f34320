"""The ``keras-sync`` command line: registers the commands, one module each (no TensorFlow here)."""

from __future__ import annotations

from typing import Any

import click

from keras_sync import __version__
from keras_sync.cli import env, init, launch, plan, schema, sync_spool, ui, validate, verify
from keras_sync.cli._base import CONTEXT, SyncGroup


@click.group(cls=SyncGroup, context_settings=CONTEXT)
@click.version_option(__version__, "--version", "-V", prog_name="keras-sync")
def cli() -> None:
    """Make a Keras 3 training script distributed from a YAML file.

    \b
    Start:   keras-sync init && python train.py
    Check:   keras-sync validate && keras-sync plan
    """


for _module in (init, validate, plan, env, ui, schema, launch, sync_spool, verify):
    # The listing shows each command's whole first paragraph, where click would cut it with "...".
    _module.command.short_help = (_module.command.help or "").split("\n\n")[0]
    cli.add_command(_module.command)


def main(args: list[str] | None = None, *, standalone_mode: bool = True) -> Any:
    """Entry point of the ``keras-sync`` console script."""
    return cli.main(args=args, prog_name="keras-sync", standalone_mode=standalone_mode)


__all__ = ["cli", "main"]
