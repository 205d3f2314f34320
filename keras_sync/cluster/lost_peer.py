"""Turn TensorFlow's "a peer is gone" errors into one line that names the peer and how to resume.

When a worker dies or its host becomes unreachable, TensorFlow's coordination service (its
heartbeats) or a collective ends every other worker with a ~50-line `UnavailableError` or
`DeadlineExceededError` traceback: "The following tasks are unhealthy (stopped sending
heartbeats): /job:worker/replica:0/task:1" on the side that still sees the service, only
"Deadline Exceeded ... Heartbeat" on a worker cut off from it. `lost_peer_message` names the
peer with its address from the cluster spec: the tasks the error names, else (an isolated worker)
the coordination service's host, the chief. Pure Python; the error is matched by class name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from keras_sync.cluster import TRAINING_JOBS, chief_task
from keras_sync.errors import PeerLostError

# Exit code of a worker that lost a peer: 75 = EX_TEMPFAIL ("temporary failure; retry").
PEER_LOST_EXIT_CODE = PeerLostError.exit_code

# FailedPreconditionError: what a peer answers once a foreign client (any host that reaches its port:
# TensorFlow's server has no authentication) has reset its eager context or device incarnations.
_ERROR_CLASSES = (
    "UnavailableError",
    "DeadlineExceededError",
    "AbortedError",
    "CancelledError",
    "InternalError",
    "FailedPreconditionError",
)
_SIGNS = (
    "unhealthy",
    "heartbeat",
    "collective ops is aborted",
    "coordination service",
    "socket closed",
    "connection reset",
    "failed to connect",
    "stopped sending",
    "has crashed",
    "have crashed",
    "from remote target",
    "incarnation",
)
_TASK_RE = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")
_UNHEALTHY_RE = re.compile(r"unhealthy[^:]*:\s*((?:\s*/job:\w+/replica:\d+/task:\d+,?)+)", re.I)


def is_lost_peer_error(exc: BaseException) -> bool:
    """True for TensorFlow errors that say a peer or the coordination service is unreachable."""
    if type(exc).__name__ not in _ERROR_CLASSES:
        return False
    text = str(exc).lower()
    return any(sign in text for sign in _SIGNS)


def _tasks(cluster: Mapping[str, Sequence[str]]) -> dict[tuple[str, int], str]:
    out: dict[tuple[str, int], str] = {}
    for job in TRAINING_JOBS:
        for i, addr in enumerate(cluster.get(job) or []):
            out[(job, i)] = addr
    return out


def lost_peers(
    text: str, cluster: Mapping[str, Sequence[str]], me: tuple[str, int]
) -> list[tuple[str, int]]:
    """The tasks this worker lost, from an error's text.

    >>> c = {"worker": ["10.0.0.1:1", "10.0.0.2:2", "10.0.0.3:3"]}
    >>> lost_peers("tasks are unhealthy (stopped sending heartbeats):\\n/job:worker/replica:0/task:2", c, ("worker", 0))
    [('worker', 2)]
    >>> lost_peers("Deadline Exceeded ... Heartbeat", c, ("worker", 1))  # cut off: the service's host
    [('worker', 0)]
    >>> lost_peers("Deadline Exceeded", c, ("worker", 0))  # the service's host, told nothing: everyone else
    [('worker', 1), ('worker', 2)]
    """
    tasks = _tasks(cluster)
    unhealthy = _UNHEALTHY_RE.search(text)
    named = _TASK_RE.findall(unhealthy.group(1) if unhealthy else text)
    peers = [t for t in dict.fromkeys((j, int(i)) for j, i in named) if t in tasks and t != me]
    if peers:
        return peers
    leader = chief_task(cluster)  # the coordination service's host
    if me != leader and leader in tasks:
        return [leader]
    return [t for t in tasks if t != me]


def lost_peer_message(
    text: str,
    cluster: Mapping[str, Sequence[str]],
    me: tuple[str, int],
    *,
    backup_dir: str | None = None,
    backup_known: bool = True,
) -> str:
    """The one line a worker ends with after losing a peer (without the ``keras-sync:`` prefix)."""
    tasks = _tasks(cluster)
    peers = lost_peers(text, cluster, me)
    who = ", ".join(f"/job:{j}/task:{i} ({tasks[(j, i)]})" for j, i in peers) or "a peer"
    if backup_dir:
        resume = f"with fault_tolerance.backup_dir={backup_dir} it resumes from the last backup"
    elif backup_known:
        resume = (
            "set fault_tolerance.backup_dir to resume where it stopped instead of from the start"
        )
    else:
        resume = "with fault_tolerance.backup_dir set it resumes from the last backup"
    return (
        f"/job:{me[0]}/task:{me[1]} lost contact with {who}: the worker stopped, or its host or the network "
        f"failed (TensorFlow: {_reason(text)}). Relaunch every worker to continue; {resume}."
    )


def _reason(text: str) -> str:
    low = text.lower()
    if "stopped sending heartbeats" in low or "unhealthy" in low:
        return "stopped sending heartbeats"
    if "heartbeat" in low:
        return "heartbeat deadline exceeded"
    if "collective ops is aborted" in low:
        return "collective aborted"
    first = text.strip().splitlines()[0] if text.strip() else "unavailable"
    return first[:120]


def from_tf_config(text: str, environ: Mapping[str, str] | None = None) -> str | None:
    """`lost_peer_message` with the cluster from ``$TF_CONFIG``, or None without one."""
    raw = (environ if environ is not None else os.environ).get("TF_CONFIG", "")
    try:
        data = json.loads(raw)
        cluster = data["cluster"]
        me = (str(data["task"]["type"]), int(data["task"]["index"]))
    except (ValueError, KeyError, TypeError):
        return None
    return lost_peer_message(text, cluster, me, backup_known=False)


@contextlib.contextmanager
def raised_as_peer_lost(strategy: Any, backup_dir: str | None) -> Iterator[None]:
    """Around `fit`, `evaluate`, `predict`: a lost-peer TensorFlow error becomes `PeerLostError`
    with the one-line message (the cluster from the strategy, else from ``$TF_CONFIG``)."""
    try:
        yield
    except Exception as e:
        if isinstance(e, PeerLostError) or not is_lost_peer_error(e):
            raise
        resolver = getattr(strategy, "cluster_resolver", None)
        if resolver is None:
            message = from_tf_config(str(e))
            if message is None:
                raise
            raise PeerLostError(message) from e
        try:
            cluster = {
                job: list(tasks.values()) if isinstance(tasks, dict) else list(tasks)
                for job, tasks in resolver.cluster_spec().as_dict().items()
            }
            me = (str(resolver.task_type), int(resolver.task_id))
        except (
            Exception
        ):  # pragma: no cover - a resolver without a cluster: keep TensorFlow's error
            raise e from None
        if len(_tasks(cluster)) < 2:
            raise
        raise PeerLostError(lost_peer_message(str(e), cluster, me, backup_dir=backup_dir)) from e
