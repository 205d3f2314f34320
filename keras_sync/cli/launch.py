from __future__ import annotations

import sys
from typing import Any

import click

from keras_sync.cli._base import SCRIPT_CONTEXT, UserError
from keras_sync.errors import KerasSyncError


@click.command("launch", context_settings=SCRIPT_CONTEXT)
@click.option(
    "--workers", "-n", type=click.IntRange(min=1), default=2, help="Number of worker processes."
)
@click.option("--config", type=click.Path(), help="keras-sync YAML file (sets $KERAS_SYNC_CONFIG).")
@click.option(
    "--grace-period",
    "grace_period_s",
    type=click.FloatRange(min=0),
    default=5.0,
    help="Seconds between SIGTERM and SIGKILL when a worker fails or on Ctrl-C.",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    help="When a worker fails, stop the others and start the whole job again, up to N times.",
)
@click.option(
    "--private-network",
    is_flag=True,
    help="Run the workers in a network namespace of their own (Linux, as root): no other host "
    "reaches them, nor they any network (use a sqlite or file tracking URI).",
)
@click.argument("script", type=click.Path())
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(script: str, args: tuple[str, ...], **options: Any) -> None:
    """Run SCRIPT [ARGS...] as --workers processes on 127.0.0.1, each with its own TF_CONFIG.

    Output lines come back prefixed [w0], [w1], ...; the exit code is the first failing
    worker's in the last try (0 when all succeed). Every try keeps the same $KERAS_SYNC_JOB_ID,
    so with fault_tolerance.backup_dir a restart resumes and continues its MLflow run.
    Ctrl-C stops every worker (with a backup_dir, after a backup at one step) and exits 130;
    a second Ctrl-C kills them at once.

    TensorFlow's servers listen on every interface (0.0.0.0) and run whatever a client
    sends them, without authentication: keep the workers behind a firewall or on a
    trusted network, or pass --private-network.
    """
    from keras_sync.launch import launch

    try:  # also run outside the group, as `python -m keras_sync.launch`
        code = launch(script, list(args), **options)
    except KerasSyncError as exc:
        raise UserError(str(exc)) from None
    sys.exit(code)
