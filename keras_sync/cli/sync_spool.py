"""``keras-sync sync-spool``: send metrics buffered while MLflow was unreachable."""

from __future__ import annotations

import click


@click.command("sync-spool")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--tracking-uri", help="Where to send them (default: the URI recorded in the spool).")
def command(path: str, tracking_uri: str | None) -> None:
    """Replay the spool file PATH into MLflow; safe to run again (delivered records are skipped)."""
    from keras_sync.tracking import replay_spool

    sent = replay_spool(path, tracking_uri=tracking_uri)
    click.echo(f"{path}: sent {sent} metric point(s) to MLflow")
