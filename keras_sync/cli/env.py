"""``keras-sync env``: versions, devices and cluster, as a block to paste into a bug report."""

from __future__ import annotations

import click


@click.command("env")
@click.option(
    "--no-devices", is_flag=True, help="Skip the device list (it imports TensorFlow, ~4 s)."
)
def command(no_devices: bool) -> None:
    """Print versions, devices and the TF_CONFIG summary (redacted) for a bug report."""
    from keras_sync.cli.env_report import collect, format_report

    click.echo(format_report(collect(devices=not no_devices)))
