"""Build `tf.distribute.MultiWorkerMirroredStrategy` with several local devices and a join timeout
(the stock constructor takes one CPU device per worker and waits for peers forever); both fixes use
TensorFlow internals (`keras_sync.upstream.multi_worker`)."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from keras_sync.cluster import TRAINING_JOBS, training_tasks
from keras_sync.config import COMMUNICATIONS
from keras_sync.errors import ConnectTimeoutError, StrategyError

if TYPE_CHECKING:
    import tensorflow as tf

logger = logging.getLogger(__name__)


def canonical(name: str, *, where: str) -> str:
    """A device name read one way: ``"/job:localhost/replica:0/task:0/device:CPU:1"``, ``"/cpu:1"``,
    ``"cpu:1"`` and ``"CPU:1"`` all give ``"CPU:1"``; else `StrategyError` naming ``where``."""
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


def _device_names(local_devices: list[str]) -> tuple[list[str], str]:
    """Each name as ``"CPU:1"`` (all of one type, none twice), and that type."""
    if isinstance(local_devices, str) or not local_devices:
        expected = '. Expected a non-empty list of device names such as ["CPU:0", "CPU:1"], or None for TensorFlow\'s default (all GPUs, else CPU:0).'
        raise _bad_argument("local_devices", local_devices, expected)
    names = [canonical(d, where="argument `local_devices`") for d in local_devices]
    types = sorted({n.split(":")[0] for n in names})
    if len(types) != 1:
        msg = f", which mixes {types}. Expected devices of one type (all CPU or all GPU)."
        raise _bad_argument("local_devices", local_devices, msg)
    if len(set(names)) != len(names):
        msg = ", which repeats a device. Expected each device once."
        raise _bad_argument("local_devices", local_devices, msg)
    return names, types[0]


def build_multi_worker_strategy(
    *,
    communication: str = "auto",
    cluster_resolver: Any = None,
    local_devices: list[str] | None = None,
    connect_timeout_s: float = 300.0,
) -> tf.distribute.MultiWorkerMirroredStrategy:
    """A `MultiWorkerMirroredStrategy` with one replica per (worker, local device), built before
    TensorFlow initialises its runtime. ``cluster_resolver`` defaults to `TF_CONFIG`'s (one training
    task or none: a single worker, no server); ``local_devices`` (e.g. ``["CPU:0", "CPU:1"]``, the same
    count on every worker) defaults to TensorFlow's choice; peers that do not join within
    ``connect_timeout_s`` raise `ConnectTimeoutError`."""
    import tensorflow as tf

    from keras_sync.upstream import multi_worker as _mw

    key = communication.lower() if isinstance(communication, str) else communication
    if key not in COMMUNICATIONS:
        expected = f". Expected one of {list(COMMUNICATIONS)}."
        raise _bad_argument("communication", communication, expected)
    if not isinstance(connect_timeout_s, (int, float)) or connect_timeout_s <= 0:
        expected = ". Expected a number of seconds > 0."
        raise _bad_argument("connect_timeout_s", connect_timeout_s, expected)
    devices = _device_names(local_devices) if local_devices is not None else None
    implementation = getattr(tf.distribute.experimental.CommunicationImplementation, key.upper())
    options = tf.distribute.experimental.CommunicationOptions(implementation=implementation)
    resolver = cluster_resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver()
    tasks = training_tasks(resolver.cluster_spec().as_dict())
    strategy_cls = _mw.strategy_class()
    if len(tasks) <= 1:
        # One training task: TF would still start a gRPC server and a coordination service.
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({}),
            task_type=resolver.task_type,
            task_id=resolver.task_id,
            rpc_layer=resolver.rpc_layer,
        )
        return strategy_cls(resolver, options, devices)
    me = f"/job:{resolver.task_type}/replica:0/task:{resolver.task_id}"
    configured = barrier = False
    if resolver.task_type in TRAINING_JOBS:
        timeout_ms = int(connect_timeout_s * 1000)
        configured, barrier = _mw.configure_coordination(
            resolver.cluster_spec(), timeout_ms, TRAINING_JOBS
        )
    if not (configured and barrier):
        why = "bounds the chief's wait only (this TensorFlow has no registration barrier)"
        if not configured:
            why = "is not applied (the coordination service is already set up, or the task does not train)"
        logger.warning("keras-sync: strategy.connect_timeout_s for task %s %s", me, why)
    try:
        return strategy_cls(resolver, options, devices)
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as e:
        # The peers the error names, else every other task.
        named = {(j, int(t)) for j, t in re.findall(r"/job:(\w+)/replica:\d+/task:(\d+)", str(e))}
        others = [t for t in tasks if t != (resolver.task_type, resolver.task_id)]
        missing = [t for t in others if t in named] or others
        who = ", ".join(f"/job:{j}/task:{i} ({tasks[(j, i)]})" for j, i in missing)
        raise ConnectTimeoutError(
            f"Workers did not join the cluster within strategy.connect_timeout_s={connect_timeout_s:g} s: missing {who}. Start them, check their addresses in TF_CONFIG, or raise strategy.connect_timeout_s."
        ) from e
    except RuntimeError as e:
        if "at program startup" not in str(e):
            raise
        # Something already ran an op: the collective runtime can no longer be set up.
        raise StrategyError(
            f"Cannot build the multi-worker strategy for task {me}: TensorFlow has already initialised in this process. Build it (keras_sync.load) first, before creating any tensor, model or dataset or calling tf.config.list_logical_devices. ({e})"
        ) from None
