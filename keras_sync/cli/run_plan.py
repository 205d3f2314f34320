"""What a training run would do with this config, computed without training.

`make_plan` answers, before any TensorFlow starts: which strategy ``auto`` picks and why,
the devices, workers and replicas, the per-replica and global batch, the scaled learning
rate and warmup, and where MLflow writes (credentials redacted). Every value says where
it came from: ``flag``, ``env``, ``file``, ``default``, or ``detected``/``derived`` when
keras-sync worked it out from the others.

Pure: no TensorFlow import (device detection is the cheap one in `keras_sync.strategy`, and the
devices come from `strategy.device_layout`, the function the strategy builders use).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from keras_sync.config import Config
from keras_sync.config.kinds import KINDS, LAYOUT_TPU


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
    items: list[PlanItem] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"config": file, "items": {key: {"value", "source", "note"}}}``."""
        return {
            "config": self.config_file,
            "items": {
                i.key: {"value": i.value, "source": i.source, "note": i.note} for i in self.items
            },
        }

    def format(self) -> str:
        """An aligned text table: key, value, source, note."""
        rows = [(i.key, _show(i.value), i.source, i.note) for i in self.items]
        widths = [max(len(r[c]) for r in rows) for c in range(3)]
        lines = [f"config: {self.config_file}"]
        for key, value, source, note in rows:
            line = f"  {key:<{widths[0]}}  {value:<{widths[1]}}  [{source}]"
            if note:
                line = f"{line:<{widths[0] + widths[1] + widths[2] + 8}}  {note}"
            lines.append(line.rstrip())
        return "\n".join(lines)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _slurm_ports(config: Config, env: Mapping[str, str]) -> PlanItem:
    from keras_sync import cluster

    base = cluster.fixed_slurm_port_base(config.strategy)
    if base is not None:
        return PlanItem(
            "strategy.slurm.port_base", base, config.source_of("strategy.slurm.port_base")
        )
    return PlanItem(
        "strategy.slurm.port_base",
        cluster.slurm_port_base(env),
        "derived",
        f"auto: from $SLURM_JOB_ID={env.get('SLURM_JOB_ID')} and $SLURM_STEP_ID={env.get('SLURM_STEP_ID')}",
    )


def make_plan(config: Config, *, environ: Mapping[str, str] | None = None) -> Plan:
    """The plan of a run with `config` in the environment `environ` (default ``os.environ``).

    Raises:
        KerasSyncError: when the values do not fit together (e.g. a global batch that does not
            divide by the replica count, or a malformed TF_CONFIG).
    """
    from keras_sync import strategy, tracking
    from keras_sync.training import scaling

    src = config.source_of
    env = os.environ if environ is None else environ
    det = strategy.detect(config, environ=env)
    spec = KINDS[det.kind]
    workers, where = strategy.count_workers(config, env)
    if not spec.multi_process:
        workers, where = 1, f"{det.kind} runs in one process"
    if spec.layout == LAYOUT_TPU:
        devices, per_worker = [f"TPU {config.strategy.tpu.name}"], 8
    else:
        layout = strategy.device_layout(
            det.kind, config.strategy, gpus=strategy.count_gpus_cheaply()
        )
        logical = " (logical)" if layout.source == "simulated" else ""
        devices, per_worker = [f"{d}{logical}" for d in layout.devices], len(layout.devices)
    replicas = workers * per_worker
    items = [
        PlanItem("strategy.kind", config.strategy.kind, src("strategy.kind")),
        PlanItem("strategy.chosen", det.kind, "detected", det.reason),
        PlanItem("devices", devices, "detected", "per worker"),
        PlanItem("workers", workers, "env" if workers > 1 else "default", where),
        PlanItem("replicas", replicas, "derived", f"{workers} worker(s) x {per_worker} device(s)"),
    ]
    if spec.layout == LAYOUT_TPU:
        items[-1] = PlanItem(
            "replicas",
            replicas,
            "derived",
            "assumes 8 TPU cores; the real count is known when the TPU system starts",
        )
    if spec.multi_process and config.strategy.cluster == "slurm" and workers > 1:
        items.append(_slurm_ports(config, env))
    b = config.batch
    per_replica, global_batch = scaling.resolve_batch_sizes(b.per_replica, b.global_, replicas)
    if b.global_ is not None:
        items.append(PlanItem("batch.global", global_batch, src("batch.global")))
        items.append(
            PlanItem(
                "batch.per_replica", per_replica, "derived", f"{global_batch} / {replicas} replicas"
            )
        )
    else:
        items.append(PlanItem("batch.per_replica", per_replica, src("batch.per_replica")))
        items.append(
            PlanItem(
                "batch.global", global_batch, "derived", f"{per_replica} x {replicas} replicas"
            )
        )
    items += _input_items(config, global_batch, replicas, workers)
    rt = config.runtime
    acc = rt.gradient_accumulation_steps
    items.append(
        PlanItem(
            "runtime.gradient_accumulation_steps", acc, src("runtime.gradient_accumulation_steps")
        )
    )
    effective = global_batch * acc
    items.append(
        PlanItem(
            "batch.effective",
            effective,
            "derived",
            f"{global_batch} x {acc} micro-batches per optimizer update",
        )
    )
    for key in (
        "steps_per_execution",
        "jit_compile",
        "mixed_precision",
        "sync_batch_norm",
        "train_step_gradients",
    ):
        given = src(f"runtime.{key}") != "default"
        note = (
            ""
            if given or key in ("mixed_precision", "sync_batch_norm", "train_step_gradients")
            else "default: your model.compile value is kept"
        )
        items.append(PlanItem(f"runtime.{key}", getattr(rt, key), src(f"runtime.{key}"), note))
    lr = config.learning_rate
    base_batch = lr.base_batch_size or per_replica
    scaled = scaling.scale_learning_rate(
        lr.base, global_batch_size=effective, base_batch_size=base_batch, rule=lr.scaling
    )
    items += [
        PlanItem("learning_rate.base", lr.base, src("learning_rate.base")),
        # null (in the file or by default) means "the per-replica batch": the number shown is derived
        PlanItem(
            "learning_rate.base_batch_size",
            base_batch,
            src("learning_rate.base_batch_size") if lr.base_batch_size else "derived",
            "" if lr.base_batch_size else "null = the per-replica batch",
        ),
        PlanItem("learning_rate.scaling", lr.scaling, src("learning_rate.scaling")),
        PlanItem(
            "learning_rate.scaled",
            scaled,
            "derived",
            scaling.lr_formula(lr.scaling, lr.base, effective, base_batch),
        ),
    ]
    if lr.warmup_epochs:
        items.append(
            PlanItem(
                "learning_rate.warmup_epochs",
                lr.warmup_epochs,
                src("learning_rate.warmup_epochs"),
                "steps = ceil(epochs x steps per epoch), known at fit",
            )
        )
    else:
        items.append(
            PlanItem(
                "learning_rate.warmup_steps",
                lr.warmup_steps,
                src("learning_rate.warmup_steps"),
                "" if lr.warmup_steps else "no warmup",
            )
        )
    items += _stack_items(env)
    m = config.mlflow
    items.append(PlanItem("mlflow.enabled", m.enabled, src("mlflow.enabled")))
    if m.enabled:
        # load_config applied flag > env > file; only the default is left to fill in.
        uri, _ = tracking.resolve_tracking_uri(m.tracking_uri)
        uri_source = src("mlflow.tracking_uri") if m.tracking_uri else "default"
        items.append(
            PlanItem(
                "mlflow.tracking_uri",
                tracking.redact_uri(uri),
                uri_source,
                "flag > $MLFLOW_TRACKING_URI > file > default",
            )
        )
        items.append(PlanItem("mlflow.experiment", m.experiment, src("mlflow.experiment")))
        items.append(
            PlanItem(
                "mlflow.job_id",
                m.job_id,
                src("mlflow.job_id"),
                "runs with this job id share one MLflow run"
                if m.job_id
                else "a new run; a relaunch that restores a backup continues its run",
            )
        )
    return Plan(config.source, items)


def _stack_items(env: Mapping[str, str]) -> list[PlanItem]:
    """The Keras backend and the TensorFlow distributions installed (keras-sync needs tensorflow and one)."""
    from keras_sync.upstream import stack

    backend, source = stack.keras_backend(env)
    note = f"from {source}" if source != "default" else "Keras's default"
    if backend != "tensorflow":
        note += "; keras-sync needs tensorflow: keras_sync.load() refuses this"
    dists = stack.tensorflow_distributions()
    return [
        PlanItem(
            "keras.backend", backend, "env" if source == "$KERAS_BACKEND" else "detected", note
        ),
        PlanItem(
            "tensorflow",
            stack.describe_tensorflow(dists),
            "detected",
            "the one distribution of the tensorflow package" if len(dists) == 1 else "",
        ),
    ]


def _input_items(config: Config, global_batch: int, replicas: int, workers: int) -> list[PlanItem]:
    """How training data will be sharded and batched: decided by the data (`keras_sync.training.pipeline`)."""
    from keras_sync.training.pipeline import batch_layout, shard_choice

    policy = config.batch.shard_policy
    arrays = shard_choice("arrays", configured=policy)
    datasets = shard_choice("dataset", configured=policy)
    items = [
        PlanItem("batch.shard_policy", policy, config.source_of("batch.shard_policy")),
        PlanItem("input.arrays", f"shard {arrays.policy}", "derived", arrays.reason),
        PlanItem(
            "input.datasets",
            f"own policy, else {datasets.policy}",
            "derived",
            f"a tf.data.Dataset whose options set a policy keeps it (Ray Data: off); else {datasets.reason}",
        ),
        PlanItem(
            "input.batched_datasets",
            f"rebatched to {global_batch}",
            "derived",
            "a dataset given to fit with another or an unknown batch is rebatched to the global batch",
        ),
    ]
    if workers > 1:
        items.append(
            PlanItem(
                "batch.per_worker",
                global_batch // workers,
                "derived",
                batch_layout(global_batch, replicas, workers),
            )
        )
    return items


def config_summary(config: Config) -> str:
    """One line on a valid config, for `keras-sync validate` (no detection, no TensorFlow)."""
    b, lr, m = config.batch, config.learning_rate, config.mlflow
    batch = (
        f"global batch {b.global_}"
        if b.global_ is not None
        else f"per-replica batch {b.per_replica}"
    )
    target = "mlflow off"
    if m.enabled:
        target = f"mlflow experiment {m.experiment!r}"
    return (
        f"{config.source}: OK (strategy {config.strategy.kind}, {batch}, "
        f"learning rate {lr.base:g} scaled {lr.scaling}, {target})"
    )
