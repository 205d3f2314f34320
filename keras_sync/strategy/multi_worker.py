"""Build `tf.distribute.MultiWorkerMirroredStrategy` with local devices and a join timeout.

Two things the stock constructor does not give: several local devices per worker on CPU (so
workers x local devices replicas take part in every all-reduce), and a bounded wait for peers (a
worker whose peer never starts blocks forever and ignores SIGTERM). Both need TensorFlow internals
(`keras_sync.upstream.multi_worker`); a peer that does not join ends in `ConnectTimeoutError`
naming its address.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from keras_sync.cluster import TRAINING_JOBS
from keras_sync.config import COMMUNICATIONS
from keras_sync.errors import ConnectTimeoutError, StrategyError

if TYPE_CHECKING:
    import tensorflow as tf

logger = logging.getLogger(__name__)

_TASK_RE = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


def local_cpu_devices() -> list[str]:
    """Names of the logical CPU devices configured in this process (``["CPU:0", ...]``).

    Reads the logical-device configuration without initialising TensorFlow, so it
    can be called before the strategy is built (after that, devices are frozen).
    """
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    if not cpus:
        return ["CPU:0"]
    logical = tf.config.get_logical_device_configuration(cpus[0]) or [None]
    return [f"CPU:{i}" for i in range(len(logical))]


def _normalize_devices(local_devices: list[str]) -> tuple[list[str], str]:
    """``"/job:localhost/.../device:CPU:1"`` or ``"cpu:1"`` -> ``"CPU:1"``; one device type only.

    Each name is read by `keras_sync.strategy.devices.canonical`.
    """
    if isinstance(local_devices, str) or not local_devices:
        raise StrategyError(
            "Invalid value for argument `local_devices`. "
            f"Received: local_devices={local_devices!r}. "
            'Expected a non-empty list of device names such as ["CPU:0", "CPU:1"], '
            "or None for TensorFlow's default (all GPUs, else CPU:0)."
        )
    from keras_sync.strategy.devices import canonical

    names = [canonical(d, where="argument `local_devices`") for d in local_devices]
    types = {n.split(":")[0] for n in names}
    if len(types) != 1:
        raise StrategyError(
            "Invalid value for argument `local_devices`. "
            f"Received: local_devices={local_devices!r}, which mixes {sorted(types)}. "
            "Expected devices of one type (all CPU or all GPU)."
        )
    if len(set(names)) != len(names):
        raise StrategyError(
            f"Invalid value for argument `local_devices`. Received: local_devices={local_devices!r}, "
            "which repeats a device. Expected each device once."
        )
    return names, types.pop()


def _training_tasks(cluster: dict[str, Any]) -> dict[str, str]:
    """``{"/job:worker/replica:0/task:1": "host:port"}`` for the chief and worker tasks."""
    out: dict[str, str] = {}
    for job in TRAINING_JOBS:
        tasks = cluster.get(job) or []
        items = tasks.items() if isinstance(tasks, dict) else enumerate(tasks)
        for i, addr in items:
            out[f"/job:{job}/replica:0/task:{int(i)}"] = addr
    return out


def _connect_timeout_error(
    error: Exception, tasks: dict[str, str], me: str, timeout_s: float
) -> ConnectTimeoutError:
    named = [f"/job:{j}/replica:0/task:{t}" for j, t in _TASK_RE.findall(str(error))]
    missing = [t for t in dict.fromkeys(named) if t in tasks and t != me]
    if not missing:  # the message named no peer: every other task is a suspect
        missing = [t for t in tasks if t != me]
    who = ", ".join(f"{t.replace('/replica:0', '')} ({tasks[t]})" for t in missing)
    return ConnectTimeoutError(
        f"Workers did not join the cluster within strategy.connect_timeout_s={timeout_s:g} s: "
        f"missing {who}. Start them, check their addresses in TF_CONFIG, "
        "or raise strategy.connect_timeout_s."
    )


def build_multi_worker_strategy(
    *,
    communication: str = "auto",
    cluster_resolver: Any = None,
    local_devices: list[str] | None = None,
    connect_timeout_s: float = 300.0,
) -> tf.distribute.MultiWorkerMirroredStrategy:
    """Build a `MultiWorkerMirroredStrategy`: one replica per (worker, local device).

    Args:
        communication: all-reduce implementation, ``"auto"``, ``"ring"`` or ``"nccl"``
            (case-insensitive).
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`; default
            reads `TF_CONFIG`. With no `TF_CONFIG` or a single training task the
            strategy runs as one worker (no server, no port).
        local_devices: devices each worker trains on, e.g. ``["CPU:0", "CPU:1"]``
            (see `local_cpu_devices()`); None keeps TensorFlow's choice (all GPUs,
            else CPU:0). Every worker must pass the same count.
        connect_timeout_s: seconds to wait for every chief/worker task to join
            before raising `ConnectTimeoutError`.

    Must run before TensorFlow initialises its runtime (before any op runs), as
    TensorFlow requires for every multi-worker strategy.
    """
    import tensorflow as tf

    from keras_sync.upstream import multi_worker as _mw

    impls = {
        name: getattr(tf.distribute.experimental.CommunicationImplementation, name.upper())
        for name in COMMUNICATIONS
    }
    key = communication.lower() if isinstance(communication, str) else communication
    if key not in impls:
        raise StrategyError(
            f"Invalid value for argument `communication`. Received: communication={communication!r}. "
            f"Expected one of {list(COMMUNICATIONS)}."
        )
    if not isinstance(connect_timeout_s, (int, float)) or connect_timeout_s <= 0:
        raise StrategyError(
            "Invalid value for argument `connect_timeout_s`. "
            f"Received: connect_timeout_s={connect_timeout_s!r}. Expected a number of seconds > 0."
        )
    devices = _normalize_devices(local_devices) if local_devices is not None else None
    options = tf.distribute.experimental.CommunicationOptions(implementation=impls[key])

    resolver = cluster_resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = resolver.cluster_spec().as_dict()
    tasks = _training_tasks(cluster)
    strategy_cls = _mw.strategy_class()

    if len(tasks) <= 1:
        # No TF_CONFIG, or one training task: TF would still start a gRPC server on the
        # task's port and a coordination service; one worker needs neither.
        logger.info(
            "MultiWorkerMirroredStrategy as a single worker: cluster has %d training task(s)",
            len(tasks),
        )
        local = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({}),
            task_type=resolver.task_type,
            task_id=resolver.task_id,
            rpc_layer=resolver.rpc_layer,
        )
        return strategy_cls(local, options, devices)

    me = f"/job:{resolver.task_type}/replica:0/task:{resolver.task_id}"
    configured, barrier = (
        _mw.configure_coordination(
            resolver.cluster_spec(), int(connect_timeout_s * 1000), TRAINING_JOBS
        )
        if resolver.task_type in TRAINING_JOBS
        else (False, False)
    )
    if not configured:
        logger.warning(
            "Coordination service already configured or task %s is not a training task; "
            "strategy.connect_timeout_s is not applied",
            me,
        )
    elif not barrier:
        logger.warning(
            "keras-sync: TensorFlow %s has no coordination-service registration barrier: "
            "strategy.connect_timeout_s bounds the chief's wait for the others; a worker whose "
            "chief never starts waits as TensorFlow decides.",
            tf.__version__,
        )
    try:
        return strategy_cls(resolver, options, devices)
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as e:
        raise _connect_timeout_error(e, tasks, me, connect_timeout_s) from e
    except RuntimeError as e:
        if "at program startup" not in str(e):
            raise
        # Something already ran a TensorFlow op (or listed logical devices): the
        # collective runtime of a multi-worker job can no longer be set up.
        raise StrategyError(
            f"Cannot build the multi-worker strategy for task {me}: TensorFlow has already "
            "initialised in this process. Build it (keras_sync.load) first, before creating any "
            f"tensor, model or dataset or calling tf.config.list_logical_devices. ({e})"
        ) from None
