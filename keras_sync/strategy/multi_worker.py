"""Build `tf.distribute.MultiWorkerMirroredStrategy` with local devices and a join timeout.

Two things the stock constructor does not give: several local devices per worker on CPU (so
workers x local devices replicas take part in every all-reduce), and a bounded wait for peers (a
worker whose peer never starts blocks forever and ignores SIGTERM). Both need TensorFlow internals
(`keras_sync.upstream.multi_worker`); a peer that does not join ends in `ConnectTimeoutError`
naming its address. `canonical` reads a device name for this builder and the others.
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


def local_cpu_devices() -> list[str]:
    """Names of the logical CPU devices configured in this process (``["CPU:0", ...]``), read
    without initialising TensorFlow: callable before the strategy is built."""
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    logical = (tf.config.get_logical_device_configuration(cpus[0]) or [None]) if cpus else [None]
    return [f"CPU:{i}" for i in range(len(logical))]


def canonical(name: str, *, where: str) -> str:
    """A device name read one way: ``"/job:localhost/replica:0/task:0/device:CPU:1"``, ``"/cpu:1"``,
    ``"cpu:1"`` and ``"CPU:1"`` all give ``"CPU:1"``; else `StrategyError` naming ``where``, the key
    or argument the name came from (``"strategy.devices"``)."""
    import tensorflow as tf

    text = name.strip() if isinstance(name, str) else name
    try:
        # "CPU:1" alone is not a device spec; "/device:CPU:1" is ("/cpu:1" is TensorFlow's legacy form).
        spec = tf.DeviceSpec.from_string(
            text if "/" in text or ":" not in text else f"/device:{text}"
        )
    except (ValueError, TypeError):
        expected = 'names such as "CPU:0" or "/device:GPU:1"'
    else:
        if spec.device_type and spec.device_index is not None:
            return f"{spec.device_type.upper()}:{spec.device_index}"
        expected = 'a type and an index, such as "CPU:0" or "GPU:1"'
    raise StrategyError(f"Invalid device name in {where}. Received: {name!r}. Expected {expected}.")


def _bad_argument(name: str, value: Any, expected: str) -> StrategyError:
    return StrategyError(
        f"Invalid value for argument `{name}`. Received: {name}={value!r}{expected}"
    )


def _normalize_devices(local_devices: list[str]) -> tuple[list[str], str]:
    """Each name as ``"CPU:1"`` (`canonical`), and their one device type."""
    if isinstance(local_devices, str) or not local_devices:
        raise _bad_argument(
            "local_devices",
            local_devices,
            '. Expected a non-empty list of device names such as ["CPU:0", "CPU:1"], '
            "or None for TensorFlow's default (all GPUs, else CPU:0).",
        )
    names = [canonical(d, where="argument `local_devices`") for d in local_devices]
    types = {n.split(":")[0] for n in names}
    if len(types) != 1:
        msg = f", which mixes {sorted(types)}. Expected devices of one type (all CPU or all GPU)."
        raise _bad_argument("local_devices", local_devices, msg)
    if len(set(names)) != len(names):
        msg = ", which repeats a device. Expected each device once."
        raise _bad_argument("local_devices", local_devices, msg)
    return names, types.pop()


def _connect_timeout_error(
    error: Exception, tasks: dict[str, str], me: str, timeout_s: float
) -> ConnectTimeoutError:
    named = [
        f"/job:{j}/replica:0/task:{t}"
        for j, t in re.findall(r"/job:(\w+)/replica:\d+/task:(\d+)", str(error))
    ]
    # A message that names no peer: every other task is a suspect.
    missing = [t for t in dict.fromkeys(named) if t in tasks and t != me] or [
        t for t in tasks if t != me
    ]
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

    Must run before TensorFlow initialises its runtime (before any op runs), as TensorFlow
    requires for every multi-worker strategy.

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
    """
    import tensorflow as tf

    from keras_sync.upstream import multi_worker as _mw

    key = communication.lower() if isinstance(communication, str) else communication
    if key not in COMMUNICATIONS:
        raise _bad_argument(
            "communication", communication, f". Expected one of {list(COMMUNICATIONS)}."
        )
    if not isinstance(connect_timeout_s, (int, float)) or connect_timeout_s <= 0:
        raise _bad_argument(
            "connect_timeout_s", connect_timeout_s, ". Expected a number of seconds > 0."
        )
    devices = _normalize_devices(local_devices) if local_devices is not None else None
    implementation = getattr(tf.distribute.experimental.CommunicationImplementation, key.upper())
    options = tf.distribute.experimental.CommunicationOptions(implementation=implementation)
    resolver = cluster_resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver()
    tasks: dict[str, str] = {}  # "/job:worker/replica:0/task:1" -> "host:port", chief and workers
    for job in TRAINING_JOBS:
        listed = resolver.cluster_spec().as_dict().get(job) or []
        for i, address in listed.items() if isinstance(listed, dict) else enumerate(listed):
            tasks[f"/job:{job}/replica:0/task:{int(i)}"] = address
    strategy_cls = _mw.strategy_class()
    if len(tasks) <= 1:
        # No TF_CONFIG, or one training task: TF would still start a gRPC server on the
        # task's port and a coordination service; one worker needs neither.
        logger.info(
            "MultiWorkerMirroredStrategy as a single worker: %d training task(s)", len(tasks)
        )
        local = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({}),
            task_type=resolver.task_type,
            task_id=resolver.task_id,
            rpc_layer=resolver.rpc_layer,
        )
        return strategy_cls(local, options, devices)
    me = f"/job:{resolver.task_type}/replica:0/task:{resolver.task_id}"
    configured, barrier = False, False
    if resolver.task_type in TRAINING_JOBS:
        timeout_ms = int(connect_timeout_s * 1000)
        configured, barrier = _mw.configure_coordination(
            resolver.cluster_spec(), timeout_ms, TRAINING_JOBS
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
