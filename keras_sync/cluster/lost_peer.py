"""A lost peer in one line: which worker is gone, at which address, and how to resume (exit code 75).

TensorFlow's `UnavailableError` ("tasks are unhealthy ...: /job:worker/replica:0/task:1"), or
"Deadline Exceeded ... Heartbeat" on a worker cut off from the chief, matched by class and text.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from keras_sync.cluster import training_tasks
from keras_sync.errors import PeerLostError

# FailedPreconditionError: a peer's answer once a foreign client has reset its device incarnations.
_ERRORS = re.compile(
    "(Unavailable|DeadlineExceeded|Aborted|Cancelled|Internal|FailedPrecondition)Error"
)
_SIGNS = re.compile(
    "unhealthy|heartbeat|collective ops is aborted|coordination service|socket closed|connection reset|"
    "failed to connect|stopped sending|has crashed|have crashed|from remote target|incarnation",
    re.I,
)
_TASK_RE = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")
_UNHEALTHY_RE = re.compile(r"unhealthy[^:]*:\s*((?:\s*/job:\w+/replica:\d+/task:\d+,?)+)", re.I)
# What TensorFlow's text says, in the words of the line (the first match wins).
_REASONS = [
    ("stopped sending heartbeats", "stopped sending heartbeats"),
    ("unhealthy", "stopped sending heartbeats"),
    ("heartbeat", "heartbeat deadline exceeded"),
    ("collective ops is aborted", "collective aborted"),
]


def is_lost_peer_error(exc: BaseException) -> bool:
    """True for TensorFlow errors that say a peer or the coordination service is unreachable."""
    return bool(_ERRORS.fullmatch(type(exc).__name__) and _SIGNS.search(str(exc)))


def lost_peers(
    text: str, cluster: Mapping[str, Sequence[str]], me: tuple[str, int]
) -> list[tuple[str, int]]:
    """The tasks this worker lost, from an error's text (none named: the service's host, else all).

    >>> c = {"worker": ["10.0.0.1:1", "10.0.0.2:2", "10.0.0.3:3"]}
    >>> lost_peers("tasks are unhealthy (stopped sending heartbeats):\\n/job:worker/replica:0/task:2", c, ("worker", 0))
    [('worker', 2)]
    >>> lost_peers("Deadline Exceeded ... Heartbeat", c, ("worker", 1))  # cut off: the service's host
    [('worker', 0)]
    >>> lost_peers("Deadline Exceeded", c, ("worker", 0))  # the service's host, told nothing: everyone else
    [('worker', 1), ('worker', 2)]
    """
    tasks = training_tasks(cluster)
    unhealthy = _UNHEALTHY_RE.search(text)
    named = _TASK_RE.findall(unhealthy.group(1) if unhealthy else text)
    peers = [t for t in dict.fromkeys((j, int(i)) for j, i in named) if t in tasks and t != me]
    leader = ("chief", 0) if cluster.get("chief") else ("worker", 0)  # the coordination service
    if not peers and me != leader and leader in tasks:
        return [leader]
    return peers or [t for t in tasks if t != me]


def lost_peer_message(
    text: str,
    cluster: Mapping[str, Sequence[str]],
    me: tuple[str, int],
    *,
    backup_dir: str | None = None,
    backup_known: bool = True,
) -> str:
    """The one line a worker ends with after losing a peer (without the ``keras-sync:`` prefix)."""
    tasks = training_tasks(cluster)
    peers = lost_peers(text, cluster, me)
    who = ", ".join(f"/job:{j}/task:{i} ({tasks[(j, i)]})" for j, i in peers) or "a peer"
    resume = "set fault_tolerance.backup_dir to resume where it stopped instead of from the start"
    if backup_dir or not backup_known:
        given = f"={backup_dir}" if backup_dir else " set"
        resume = f"with fault_tolerance.backup_dir{given} it resumes from the last backup"
    first_line = (text.strip().splitlines() or ["unavailable"])[0][:120]
    reason = next((said for sign, said in _REASONS if sign in text.lower()), first_line)
    return (
        f"/job:{me[0]}/task:{me[1]} lost contact with {who}: the worker stopped, or its host or the "
        f"network failed (TensorFlow: {reason}). Relaunch every worker to continue; {resume}."
    )


@contextlib.contextmanager
def raised_as_peer_lost(strategy: Any, backup_dir: str | None) -> Iterator[None]:
    """Around `fit`, `evaluate`, `predict`: a lost-peer TensorFlow error becomes `PeerLostError`."""
    try:
        yield
    except Exception as e:
        where = None if isinstance(e, PeerLostError) else _cluster_and_task(strategy)
        if where is None or len(training_tasks(where[0])) < 2 or not is_lost_peer_error(e):
            raise
        known = getattr(strategy, "cluster_resolver", None) is not None  # else backup_dir unknown
        message = lost_peer_message(str(e), *where, backup_dir=backup_dir, backup_known=known)
        raise PeerLostError(message) from e


def _cluster_and_task(strategy: Any) -> tuple[dict[str, Any], tuple[str, int]] | None:
    """The cluster and this task, from the strategy's resolver, else from ``$TF_CONFIG``."""
    resolver = getattr(strategy, "cluster_resolver", None)
    try:
        if resolver is not None:
            task = (str(resolver.task_type), int(resolver.task_id))
            return resolver.cluster_spec().as_dict(), task
        data = json.loads(os.environ.get("TF_CONFIG", ""))
        return data["cluster"], (str(data["task"]["type"]), int(data["task"]["index"]))
    except Exception:  # no cluster to name: TensorFlow's own error stands
        return None
