from __future__ import annotations

import click

from keras_sync.cli._base import UserError


@click.command("validate")
@click.argument("config", required=False, type=click.Path())
def command(config: str | None) -> None:
    """Check CONFIG (default: $KERAS_SYNC_CONFIG or ./keras_sync.yaml).

    Prints a one-line summary, or every problem as FILE:LINE: key.path: message and
    exits with code 2. Loads no TensorFlow.
    """
    from keras_sync.config import CONFIG_ENV, DEFAULT_CONFIG_FILE, load_config

    cfg = load_config(config)
    if cfg.source == "<defaults>":
        raise UserError(
            f"no config file: ./{DEFAULT_CONFIG_FILE} does not exist and ${CONFIG_ENV} is unset; "
            "pass a path, or create one with 'keras-sync init'"
        )
    b, lr, m = cfg.batch, cfg.learning_rate, cfg.mlflow
    batch = (
        f"per-replica batch {b.per_replica}" if b.global_ is None else f"global batch {b.global_}"
    )
    target = f"mlflow experiment {m.experiment!r}" if m.enabled else "mlflow off"
    click.echo(
        f"{cfg.source}: OK (strategy {cfg.strategy.kind}, {batch}, "
        f"learning rate {lr.base:g} scaled {lr.scaling}, {target})"
    )
