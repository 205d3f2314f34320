"""Pure logic for the sync callbacks: spread, throughput, when to log, the job id, the writer check.

No TensorFlow, Keras, numpy or MLflow here, so it is tested on its own (tests/test_sync_metrics.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from keras_sync.errors import UsageError

#: Environment variable that names the job (and so its MLflow run) explicitly.
JOB_ID_ENV = "KERAS_SYNC_JOB_ID"


def check_writer(writer: Any, method: str) -> None:
    """Raise `UsageError` unless ``writer`` is None or has ``method`` (the callback's `writer` argument).

    >>> check_writer(None, "log_metrics")
    >>> check_writer("w", "log_metrics")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    keras_sync.errors.UsageError: Invalid value for argument `writer`. Received: writer='w'. Expected a ...
    """
    if writer is not None and not hasattr(writer, method):
        raise UsageError(f"Invalid value for argument `writer`. Received: writer={writer!r}. Expected a "
                         "keras_sync.tracking.MlflowWriter, or None on workers that do not write.")


def grad_norm_spread(norms: Sequence[float]) -> float:
    """How unequal the replicas' local gradient norms are: ``(max - min) / mean``.

    0 when every replica sees the same gradient size; large when one shard dominates.
    NaN when there are no norms or their mean is 0.

    >>> grad_norm_spread([1.0, 3.0])
    1.0
    >>> grad_norm_spread([2.0, 2.0, 2.0])
    0.0
    """
    if not norms:
        return math.nan
    mean = sum(norms) / len(norms)
    if mean == 0 or not math.isfinite(mean):
        return math.nan
    return (max(norms) - min(norms)) / mean


def crossed_log_step(prev_step: int, step: int, every: int) -> bool:
    """True when the global step moved past a multiple of ``every`` (steps are 1-based).

    With one optimizer step per call this is ``step % every == 0``; with several steps per
    call (``steps_per_execution``) a multiple inside the interval counts too.

    >>> [s for s in range(1, 11) if crossed_log_step(s - 1, s, 5)]
    [5, 10]
    >>> crossed_log_step(3, 7, 5), crossed_log_step(5, 9, 5)
    (True, False)
    """
    return step // every > prev_step // every


def throughput(examples: float, seconds: float, num_replicas: int) -> dict[str, float]:
    """``sync/examples_per_sec`` (all replicas) and ``sync/examples_per_sec_per_replica``.

    >>> throughput(640, 2.0, 2)
    {'sync/examples_per_sec': 320.0, 'sync/examples_per_sec_per_replica': 160.0}
    """
    if seconds <= 0 or num_replicas < 1:
        return {}
    rate = examples / seconds
    return {"sync/examples_per_sec": rate, "sync/examples_per_sec_per_replica": rate / num_replicas}


def replica_metrics(losses: Sequence[float], grad_norms: Sequence[float]) -> dict[str, float]:
    """The per-replica metric names and values, plus the grad-norm spread.

    Replica ``i`` is the ``i``-th replica of the whole job (worker 0's replicas first). NaN
    entries (a value that was not measured) are left out.

    >>> replica_metrics([0.5, 0.7], [1.0, 3.0])  # doctest: +NORMALIZE_WHITESPACE
    {'sync/replica_0/loss': 0.5, 'sync/replica_1/loss': 0.7, 'sync/replica_0/grad_norm': 1.0,
     'sync/replica_1/grad_norm': 3.0, 'sync/grad_norm_spread': 1.0}
    """
    out: dict[str, float] = {}
    for i, v in enumerate(losses):
        if not math.isnan(v):
            out[f"sync/replica_{i}/loss"] = float(v)
    finite = [float(v) for v in grad_norms if not math.isnan(v)]
    for i, v in enumerate(grad_norms):
        if not math.isnan(v):
            out[f"sync/replica_{i}/grad_norm"] = float(v)
    if len(finite) == len(grad_norms) and finite:
        out["sync/grad_norm_spread"] = grad_norm_spread(finite)
    return out


def job_id(environ: Mapping[str, str], *, experiment: str, backup_dir: str | None = None,
           cwd: str | None = None) -> str | None:
    """A job id that stays the same when a job restarts, so it continues its MLflow run.

    In order: ``$KERAS_SYNC_JOB_ID`` as given; else, with ``fault_tolerance.backup_dir``, a hash
    of the backup directory's absolute path and the experiment (a restarted job resumes from
    that directory, whatever ports its workers got); else under Slurm ``slurm-<SLURM_JOB_ID>``
    (kept on requeue); else, with a ``TF_CONFIG`` cluster, a hash of the cluster (its addresses)
    and the experiment. ``None`` otherwise: a single process without a backup directory starts
    a new run each time.

    >>> job_id({"KERAS_SYNC_JOB_ID": "resnet-7"}, experiment="x")
    'resnet-7'
    >>> job_id({}, experiment="x") is None
    True
    >>> job_id({"SLURM_JOB_ID": "123"}, experiment="x")
    'slurm-123-x'
    """
    explicit = environ.get(JOB_ID_ENV, "").strip()
    if explicit:
        return explicit
    if backup_dir:
        path = os.path.abspath(os.path.join(cwd or os.getcwd(), os.path.expanduser(backup_dir)))
        return "backup-" + _digest({"backup_dir": path, "experiment": experiment})
    slurm = environ.get("SLURM_JOB_ID", "").strip()
    if slurm:
        return _clean(f"slurm-{slurm}-{experiment}")
    raw = environ.get("TF_CONFIG", "").strip()
    if raw:
        try:
            cluster = json.loads(raw).get("cluster")
        except (ValueError, AttributeError):
            cluster = None
        if cluster:
            return "cluster-" + _digest({"cluster": cluster, "experiment": experiment})
    return None


def _digest(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _clean(text: str) -> str:
    # The writer accepts letters, digits and `_.:/@+-` only.
    return "".join(c if c.isalnum() or c in "_.:/@+-" else "_" for c in text)[:250]
