"""``keras-sync launch``: run a training script as N local workers on 127.0.0.1."""

from __future__ import annotations

import sys

import click


@click.command("launch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--workers", "-n", type=click.IntRange(min=1), default=2, show_default=True,
              help="Number of worker processes.")
@click.option("--config", type=click.Path(path_type=str), help="keras-sync YAML file (sets $KERAS_SYNC_CONFIG).")
@click.option("--grace-period", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when a worker fails or on Ctrl-C.")
@click.argument("script", type=click.Path(path_type=str))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(workers: int, config: str | None, grace_period: float, script: str, args: tuple[str, ...]) -> None:
    """Run SCRIPT [ARGS...] as --workers processes, each with its own TF_CONFIG.

    Output lines come back prefixed [w0], [w1], ...; the exit code is the first failing
    worker's (0 when all succeed).
    """
    from keras_sync.launch import launch

    sys.exit(launch(script, list(args), workers=workers, config=config, grace_period_s=grace_period))
