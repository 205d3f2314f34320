"""TensorFlow's private multi-worker pieces (feature ``multi_worker_strategy``): several local
devices per worker (TF's TODO b/126786766), a bounded wait for peers that never start
(tensorflow#60706), the coordination service's key-value store."""

from __future__ import annotations

import importlib
from typing import Any

from keras_sync.upstream import internals as _internals


def strategy_class() -> type:
    """`tf.distribute.MultiWorkerMirroredStrategy` built as ``cls(resolver, options, local_devices)``;
    ``local_devices``: None (TensorFlow's choice) or ``(["CPU:0", ...], "CPU")``."""
    _internals.require("multi_worker_strategy")
    import tensorflow as tf

    cars: Any = importlib.import_module(_internals.CARS)

    class _LocalDevicesExtended(cars.CollectiveAllReduceExtended):
        def __init__(self, container, cluster_resolver, communication_options, local_devices):
            self._ks_local_devices = local_devices
            super().__init__(container, cluster_resolver, communication_options)

        def _initialize_local_devices(self, cluster_resolver, worker_device):
            if self._ks_local_devices is None:
                return super()._initialize_local_devices(cluster_resolver, worker_device)
            names, device_type = self._ks_local_devices
            return tuple(f"{worker_device}/device:{n}" for n in names), device_type

    class MultiWorkerMirroredStrategy(cars.CollectiveAllReduceStrategy):
        def __init__(self, cluster_resolver, communication_options, local_devices):
            extended = _LocalDevicesExtended(
                self, cluster_resolver, communication_options, local_devices
            )
            tf.distribute.Strategy.__init__(self, extended)

    return MultiWorkerMirroredStrategy


def _context() -> Any:
    return importlib.import_module(_internals.CONTEXT).context()


def configure_coordination(
    cluster_spec: Any, timeout_ms: int, jobs: tuple[str, ...]
) -> tuple[bool, bool]:
    """Every task of ``jobs`` must register within ``timeout_ms``; returns (configured, with the
    barrier), (False, False) when a coordination service already is."""
    ctx = _context()
    if ctx.coordination_service is not None:
        return False, False
    util = importlib.import_module("tensorflow.python.distribute.multi_worker_util")
    spec = util.normalize_cluster_spec(cluster_spec)
    ctx.configure_coordination_service(
        "standalone",
        service_leader=util.coordination_leader(spec),
        cluster_register_timeout_in_ms=timeout_ms,
    )
    config: Any = ctx.coordination_service  # filled in place: its protobuf module moved in TF
    for name in jobs:
        if name in spec.jobs:
            config.coordinated_job_list.add(name=name, num_tasks=spec.num_tasks(name))
    # Without the barrier only the leader waits for the others; with it every task times out.
    barrier = _internals.available(_internals.BARRIER)
    if barrier:
        config.cluster_register_with_barrier = True
    return True, barrier


def set_key(key: str, value: str) -> None:
    """Post ``value`` under ``key`` in the job's coordination service."""
    _context().set_config_key_value(key, value)


def get_key(key: str, timeout_ms: int) -> str:
    """The value posted under ``key``, waiting at most ``timeout_ms`` (then DeadlineExceededError)."""
    return _context().get_config_key_value(key, timeout_ms)


def peer_health(task: str, timeout_ms: int) -> None:
    """Raise TensorFlow's error unless ``task`` (``/job:worker/replica:0/task:1``) is alive."""
    _context().check_collective_ops_peer_health(task, timeout_ms)


def joined_cluster() -> tuple[dict[str, list[str]], str, int] | None:
    """(cluster, job, task index) this process's TensorFlow already joined; None if none (or the
    internals moved)."""
    context_safe = getattr(importlib.import_module(_internals.CONTEXT), "context_safe", None)
    ctx = context_safe() if context_safe is not None else None
    server_def = ctx and (
        getattr(ctx, "_collective_ops_server_def", None) or getattr(ctx, "_server_def", None)
    )
    if not server_def:
        return None
    cluster = {j.name: [j.tasks[i] for i in sorted(j.tasks)] for j in server_def.cluster.job}
    return cluster, server_def.job_name, server_def.task_index
