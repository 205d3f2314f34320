from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import click

from keras_sync.config import STRATEGY_KINDS, Config

#: option -> the config key it overrides (a flag wins over env, file and default), and its type.
_FLAGS: dict[str, tuple[str, Any]] = {
    "strategy": ("strategy.kind", click.Choice(STRATEGY_KINDS, case_sensitive=False)),
    "per_replica_batch": ("batch.per_replica", click.IntRange(min=1)),
    "global_batch": ("batch.global", click.IntRange(min=1)),
    "base_lr": ("learning_rate.base", float),
    "simulated_cpu_replicas": ("strategy.simulated_cpu_replicas", click.IntRange(min=0)),
    "tracking_uri": ("mlflow.tracking_uri", str),
}


@click.command("plan")
@click.argument("config", required=False, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON: every value with its source.")
def command(config: str | None, as_json: bool, **flags: object) -> None:
    """Show what a run with CONFIG would use, and where each value came from.

    Strategy (and why auto picks it), devices, workers, replicas, per-replica and global
    batch, scaled learning rate and warmup, and the MLflow target (credentials redacted).
    Precedence: flag > environment > file > default.
    """
    from keras_sync.config import load_config

    overrides = {_FLAGS[name][0]: value for name, value in flags.items() if value is not None}
    batches = {"batch.global", "batch.per_replica"}
    if len(batches & overrides.keys()) == 1:  # it replaces either batch of the file (both: a clash)
        overrides.update(dict.fromkeys(batches - overrides.keys()))
    plan = make_plan(load_config(config, overrides=overrides))
    click.echo(json.dumps(plan.to_dict(), indent=2) if as_json else plan.format())


for _name, (_key, _type) in _FLAGS.items():  # the override flags, after --json
    _flag = "--" + _name.replace("_", "-")
    command.params.append(click.Option([_flag], type=_type, help=f"Override {_key}."))


@dataclass(frozen=True)
class PlanItem:
    """One planned value: its key, the value, where it came from, and a short why."""

    key: str
    value: Any
    source: str
    note: str = ""


@dataclass(frozen=True)
class Plan:
    """The values a run would use, in the order a user reads them."""

    config_file: str
    items: list[PlanItem]

    def to_dict(self) -> dict[str, Any]:
        """``{"config": file, "items": {key: {"value", "source", "note"}}}``."""
        items = {i.key: {"value": i.value, "source": i.source, "note": i.note} for i in self.items}
        return {"config": self.config_file, "items": items}

    def format(self) -> str:
        """An aligned table: key, value, source, note."""
        rows = [(i.key, _show(i.value), f"[{i.source}]", i.note) for i in self.items]
        widths = [max(len(row[c]) for row in rows) for c in range(3)]
        cells = ("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)
        lines = [f"  {line}  {row[3]}".rstrip() for line, row in zip(cells, rows)]
        return "\n".join([f"config: {self.config_file}", *lines])


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "-"
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def make_plan(config: Config, *, environ: Mapping[str, str] | None = None) -> Plan:
    """The plan of a run with `config` in `environ` (default ``os.environ``)."""
    from keras_sync import cluster, strategy, tracking
    from keras_sync.config.kinds import KINDS, LAYOUT_TPU
    from keras_sync.training import scaling
    from keras_sync.training.pipeline import batch_layout, shard_choice
    from keras_sync.upstream import stack

    env = os.environ if environ is None else environ
    items: list[PlanItem] = []

    def add(key: str, value: Any, source: str | None = None, note: str = "") -> None:
        items.append(PlanItem(key, value, source or config.source_of(key), note))

    det = strategy.detect(config, environ=env)
    spec = KINDS[det.kind]
    info, where = cluster.read_cluster(config.strategy, env)
    workers = info.num_workers
    if not spec.multi_process:
        workers, where = 1, f"{det.kind} runs in one process"
    if spec.layout == LAYOUT_TPU:
        devices, per_worker = [f"TPU {config.strategy.tpu.name}"], 8
        note = "assumes 8 TPU cores; the real count is known when the TPU system starts"
    else:
        gpus = strategy.count_gpus_cheaply()
        layout = strategy.device_layout(det.kind, config.strategy, gpus=gpus)
        logical = " (logical)" if layout.source == "simulated" else ""
        devices, per_worker = [f"{d}{logical}" for d in layout.devices], len(layout.devices)
        note = f"{workers} worker(s) x {per_worker} device(s)"
    replicas = workers * per_worker
    add("strategy.kind", config.strategy.kind)
    add("strategy.chosen", det.kind, "detected", det.reason)
    add("devices", devices, "detected", "per worker")
    add("workers", workers, "env" if workers > 1 else "default", where)
    add("replicas", replicas, "derived", note)
    if spec.multi_process and config.strategy.cluster == "slurm" and workers > 1:
        if isinstance(base := config.strategy.slurm.port_base, int):
            add("strategy.slurm.port_base", base)
        else:
            job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
            note = f"auto: from $SLURM_JOB_ID={job} and $SLURM_STEP_ID={step}"
            add("strategy.slurm.port_base", cluster.slurm_port_base(env), "derived", note)

    b = config.batch
    per_replica, global_batch = scaling.resolve_batch_sizes(b.per_replica, b.global_, replicas)
    if b.global_ is not None:
        add("batch.global", global_batch)
        add("batch.per_replica", per_replica, "derived", f"{global_batch} / {replicas} replicas")
    else:
        add("batch.per_replica", per_replica)
        add("batch.global", global_batch, "derived", f"{per_replica} x {replicas} replicas")
    # How training data will be sharded and batched (decided by the data, in training.pipeline).
    arrays = shard_choice("arrays", configured=b.shard_policy)
    datasets = shard_choice("dataset", configured=b.shard_policy)
    add("batch.shard_policy", b.shard_policy)
    add("input.arrays", f"shard {arrays.policy}", "derived", arrays.reason)
    note = "a tf.data.Dataset whose options set a policy keeps it (Ray Data: off); else "
    add("input.datasets", f"own policy, else {datasets.policy}", "derived", note + datasets.reason)
    note = "a dataset with another or an unknown batch is rebatched to the global batch"
    add("input.batched_datasets", f"rebatched to {global_batch}", "derived", note)
    if workers > 1:
        note = batch_layout(global_batch, replicas, workers)
        add("batch.per_worker", global_batch // workers, "derived", note)

    rt = config.runtime
    acc, effective = rt.gradient_accumulation_steps, global_batch * rt.gradient_accumulation_steps
    add("runtime.gradient_accumulation_steps", acc)
    note = f"{global_batch} x {acc} micro-batches per optimizer update"
    add("batch.effective", effective, "derived", note)
    for key in ("steps_per_execution", "jit_compile"):
        kept = config.source_of(f"runtime.{key}") == "default"
        note = "default: your model.compile value is kept" if kept else ""
        add(f"runtime.{key}", getattr(rt, key), None, note)
    for key in ("mixed_precision", "sync_batch_norm", "train_step_gradients"):
        add(f"runtime.{key}", getattr(rt, key))

    lr = config.learning_rate
    base_batch = lr.base_batch_size or per_replica
    scaled = scaling.scale_learning_rate(
        lr.base, global_batch_size=effective, base_batch_size=base_batch, rule=lr.scaling
    )
    add("learning_rate.base", lr.base)
    if lr.base_batch_size:
        add("learning_rate.base_batch_size", base_batch)
    else:  # null (in the file or by default) means "the per-replica batch": the number is derived
        add("learning_rate.base_batch_size", base_batch, "derived", "null = the per-replica batch")
    add("learning_rate.scaling", lr.scaling)
    formula = scaling.lr_formula(lr.scaling, lr.base, effective, base_batch)
    add("learning_rate.scaled", scaled, "derived", formula)
    if lr.warmup_epochs:
        note = "steps = ceil(epochs x steps per epoch), known at fit"
        add("learning_rate.warmup_epochs", lr.warmup_epochs, None, note)
    else:
        note = "" if lr.warmup_steps else "no warmup"
        add("learning_rate.warmup_steps", lr.warmup_steps, None, note)

    backend, source = stack.keras_backend(env)
    note = f"from {source}" if source != "default" else "Keras's default"
    if backend != "tensorflow":
        note += "; keras-sync needs tensorflow: keras_sync.load() refuses this"
    add("keras.backend", backend, "env" if source == "$KERAS_BACKEND" else "detected", note)
    dists = stack.tensorflow_distributions()
    note = "the one distribution of the tensorflow package" if len(dists) == 1 else ""
    add("tensorflow", stack.describe_tensorflow(dists), "detected", note)

    m = config.mlflow
    add("mlflow.enabled", m.enabled)
    if m.enabled:  # load_config applied flag > env > file; only the default is left to fill in
        uri, _ = tracking.resolve_tracking_uri(m.tracking_uri)
        source = config.source_of("mlflow.tracking_uri") if m.tracking_uri else "default"
        note = "flag > $MLFLOW_TRACKING_URI > file > default"
        add("mlflow.tracking_uri", tracking.redact_uri(uri), source, note)
        add("mlflow.experiment", m.experiment)
        note = "runs with this job id share one MLflow run"
        new = "a new run; a relaunch that restores a backup continues its run"
        add("mlflow.job_id", m.job_id, None, note if m.job_id else new)
    return Plan(config.source, items)
