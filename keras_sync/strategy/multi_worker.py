"""`tf.distribute.MultiWorkerMirroredStrategy` with several local devices and a join timeout (the
stock one takes one CPU per worker and waits forever), through `keras_sync.upstream.multi_worker`."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from keras_sync.cluster import TRAINING_JOBS, training_tasks
from keras_sync.errors import ConnectTimeoutError, StrategyError

if TYPE_CHECKING:
    import tensorflow as tf

logger = logging.getLogger(__name__)


def canonical(name: str, *, where: str) -> str:
    """A device name as ``"CPU:1"`` (from ``"/cpu:1"``, ``"/job:.../device:CPU:1"``...); else refused."""
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


def build_multi_worker_strategy(
    *,
    communication: str = "auto",
    cluster_resolver: Any = None,
    local_devices: list[str] | None = None,
    connect_timeout_s: float = 300.0,
) -> tf.distribute.MultiWorkerMirroredStrategy:
    """`MultiWorkerMirroredStrategy` over ``local_devices``; peers must join in ``connect_timeout_s``."""
    import tensorflow as tf

    from keras_sync.upstream import multi_worker as _mw

    devices = None
    if local_devices is not None:  # the config's simulated CPUs: one type, each once
        names = [canonical(d, where="argument `local_devices`") for d in local_devices]
        devices = (names, names[0].split(":")[0])
    implementations = tf.distribute.experimental.CommunicationImplementation
    implementation = getattr(implementations, communication.upper())
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
        timeout_ms, spec = int(connect_timeout_s * 1000), resolver.cluster_spec()
        configured, barrier = _mw.configure_coordination(spec, timeout_ms, TRAINING_JOBS)
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
        msg = f"Workers did not join the cluster within strategy.connect_timeout_s={connect_timeout_s:g} s: missing {who}. Start them, check their addresses in TF_CONFIG, or raise strategy.connect_timeout_s."
        raise ConnectTimeoutError(msg) from e
    except RuntimeError as e:
        if "at program startup" not in str(e):
            raise
        # Something already ran an op: the collective runtime can no longer be set up.
        msg = f"Cannot build the multi-worker strategy for task {me}: TensorFlow has already initialised in this process. Build it (keras_sync.load) first, before creating any tensor, model or dataset or calling tf.config.list_logical_devices. ({e})"
        raise StrategyError(msg) from None
