"""``keras-sync init``: write a commented keras_sync.yaml and a train.py that runs as is."""

from __future__ import annotations

import shlex
import sys

import click

from keras_sync.config import STRATEGY_KINDS


@click.command("init")
@click.argument("directory", required=False, default=".", type=click.Path(file_okay=False))
@click.option(
    "--strategy",
    "kind",
    type=click.Choice(STRATEGY_KINDS, case_sensitive=False),
    help="Strategy kind (default: auto).",
)
@click.option(
    "--per-replica-batch",
    type=click.IntRange(min=1),
    help="Examples per replica per step (default: 32).",
)
@click.option("--force", is_flag=True, help="Overwrite keras_sync.yaml and train.py if they exist.")
@click.option(
    "--no-input", is_flag=True, help="Ask nothing; use the defaults for what is not given."
)
def command(
    directory: str, kind: str | None, per_replica_batch: int | None, force: bool, no_input: bool
) -> None:
    """Write keras_sync.yaml and train.py into DIRECTORY (default: here).

    On a terminal it asks for the strategy and the batch; with --no-input, or when not on a
    terminal, it uses the defaults. Never overwrites a file without --force.
    """
    from keras_sync.cli.scaffold import cpu_replicas_hint, init_project
    from keras_sync.strategy import count_gpus_cheaply
    from keras_sync.tracking.shell_hint import console_command, python_command

    ask = not no_input and sys.stdin.isatty()
    if kind is None and ask:
        kind = click.prompt("Strategy kind", default="auto", type=click.Choice(STRATEGY_KINDS))
    if per_replica_batch is None and ask:
        per_replica_batch = click.prompt(
            "Per-replica batch size", default=32, type=click.IntRange(min=1)
        )
    kind = (kind or "auto").lower()
    written = init_project(
        directory, kind=kind, per_replica_batch=per_replica_batch or 32, force=force
    )
    click.echo("\n".join(f"wrote {path}" for path in written))
    if hint := cpu_replicas_hint(kind, written[0], gpus=count_gpus_cheaply()):
        click.echo(hint)
    click.echo(
        f"next: cd {shlex.quote(directory)} && {console_command()} plan && {python_command()} train.py"
    )
