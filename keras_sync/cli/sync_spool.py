"""``keras-sync sync-spool``: send metrics buffered while MLflow was unreachable."""

from __future__ import annotations

import click


@click.command("sync-spool")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--tracking-uri", help="Where to send them (default: the URI recorded in the spool, "
              "which is kept without credentials).")
def command(path: str, tracking_uri: str | None) -> None:
    """Deliver the spool directory PATH to MLflow; safe to run again (nothing is sent twice).

    A training process leaves a spool when MLflow was unreachable at its end; its warning names
    PATH (under mlflow.spool_dir, default .keras_sync_spool). A delivered spool is removed.
    """
    from keras_sync.tracking import replay_spool

    sent = replay_spool(path, tracking_uri=tracking_uri)
    click.echo(f"{path}: sent {sent} metric point(s) to MLflow")
