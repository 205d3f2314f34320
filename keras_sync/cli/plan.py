"""``keras-sync plan``: what a run would do with this config, without training."""

from __future__ import annotations

import json

import click

from keras_sync.config import STRATEGY_KINDS

#: flag -> the config key it overrides (a flag wins over env, file and default).
_FLAG_KEYS = {
    "strategy": "strategy.kind",
    "per_replica_batch": "batch.per_replica",
    "global_batch": "batch.global",
    "base_lr": "learning_rate.base",
    "simulated_cpu_replicas": "strategy.simulated_cpu_replicas",
    "tracking_uri": "mlflow.tracking_uri",
}


@click.command("plan")
@click.argument("config", required=False, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON: every value with its source.")
@click.option(
    "--strategy",
    type=click.Choice(STRATEGY_KINDS, case_sensitive=False),
    help="Override strategy.kind.",
)
@click.option("--per-replica-batch", type=click.IntRange(min=1), help="Override batch.per_replica.")
@click.option("--global-batch", type=click.IntRange(min=1), help="Override batch.global.")
@click.option("--base-lr", type=float, help="Override learning_rate.base.")
@click.option(
    "--simulated-cpu-replicas",
    type=click.IntRange(min=0),
    help="Override strategy.simulated_cpu_replicas.",
)
@click.option("--tracking-uri", help="Override mlflow.tracking_uri.")
def command(config: str | None, as_json: bool, **flags: object) -> None:
    """Show what a run with CONFIG would use, and where each value came from.

    Strategy (and why auto picks it), devices, workers, replicas, per-replica and global
    batch, scaled learning rate and warmup, and the MLflow target (credentials redacted).
    Precedence: flag > environment > file > default.
    """
    from keras_sync.cli.run_plan import make_plan
    from keras_sync.config import load_config

    overrides = {_FLAG_KEYS[name]: value for name, value in flags.items() if value is not None}
    batches = {"batch.global", "batch.per_replica"}
    if len(batches & overrides.keys()) == 1:  # it replaces either batch of the file (both: a clash)
        overrides.update(dict.fromkeys(batches - overrides.keys()))
    plan = make_plan(load_config(config, overrides=overrides))
    click.echo(json.dumps(plan.to_dict(), indent=2) if as_json else plan.format())
