"""``keras-sync sync-spool``: send metrics buffered while MLflow was unreachable."""

from __future__ import annotations

import time

import click

#: At most one progress line per this many seconds.
_EVERY_S = 5.0


@click.command("sync-spool")
@click.argument("path", type=click.Path())
@click.option(
    "--tracking-uri",
    help="Where to send them (default: the URI recorded in the spool, "
    "which is kept without credentials).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0),
    default=600.0,
    help="Seconds to retry requests that fail (no answer, HTTP 5xx) before giving up; what is left "
    "stays in the spool. 0: try each request once.",
)
def command(path: str, tracking_uri: str | None, timeout_s: float) -> None:
    """Deliver the spool directory PATH to MLflow; safe to run again (nothing is sent twice).

    A training process leaves a spool (under mlflow.spool_dir) when MLflow was unreachable at its
    end; its warning names PATH. Failing requests are retried until --timeout; a delivered spool
    is removed.
    """
    from keras_sync.tracking import replay_spool

    said, last = "", 0.0

    def progress(sent: int, total: int, failures: str) -> None:
        nonlocal said, last
        line = f"{path}: {sent} of {total} metric point(s) sent"
        line += f"; {failures} (each retried)" if failures else ""
        if line != said and time.monotonic() - last >= _EVERY_S:
            said, last = line, time.monotonic()
            click.echo(line)

    sent = replay_spool(path, tracking_uri=tracking_uri, timeout_s=timeout_s, progress=progress)
    click.echo(f"{path}: sent {sent} metric point(s) to MLflow")
