"""Pure logic for the sync callbacks: spread, throughput, when to log, the writer check."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from keras_sync.errors import UsageError


def check_writer(writer: Any, method: str) -> None:
    """Raise `UsageError` unless ``writer`` is None or has ``method`` (the callback's `writer` argument).

    >>> check_writer(None, "log_metrics")
    >>> check_writer("w", "log_metrics")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    keras_sync.errors.UsageError: Invalid value for argument `writer`. Received: writer='w', which has no ...
    """
    if writer is not None and not hasattr(writer, method):
        raise UsageError(
            f"Invalid value for argument `writer`. Received: writer={writer!r}, which has no "
            f"`{method}`. Expected a keras_sync.tracking.MlflowWriter or another object with the "
            "methods of keras_sync.tracking.Writer, or None on workers that do not write."
        )


def grad_norm_spread(norms: Sequence[float]) -> float:
    """How unequal the replicas' local gradient norms are: ``(max - min) / mean`` (NaN without
    norms or with a mean of 0).

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


def loss_spread(losses: Sequence[float]) -> float:
    """How far apart the replicas' own losses are: ``max - min`` (absolute: a loss falls towards 0,
    a ratio to it would mean nothing). NaN without losses.

    >>> loss_spread([0.5, 0.75, 0.25])
    0.5
    >>> loss_spread([0.3])
    0.0
    """
    if not losses:
        return math.nan
    return max(losses) - min(losses)


def crossed_log_step(prev_step: int, step: int, every: int) -> bool:
    """True when the global step moved past a multiple of ``every`` (several steps per call too).

    >>> [s for s in range(1, 11) if crossed_log_step(s - 1, s, 5)]
    [5, 10]
    >>> crossed_log_step(3, 7, 5), crossed_log_step(5, 9, 5)
    (True, False)
    """
    return step // every > prev_step // every


#: ``log_every_n_steps: auto``: the strides it picks from (round numbers keep the charts' steps regular).
AUTO_STRIDES = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
#: ``log_every_n_steps: auto``: the least time between two logged steps (at most 10 points a second).
AUTO_INTERVAL_S = 0.1


def auto_stride(seconds_per_step: list[float], interval_s: float = AUTO_INTERVAL_S) -> int:
    """The stride ``log_every_n_steps: auto`` logs at: the smallest of `AUTO_STRIDES` whose steps
    take at least ``interval_s``, from the median time per step (the first step of a `fit`,
    which traces, does not move a median).

    >>> auto_stride([0.002] * 31 + [4.0])  # 2-ms steps: 500 a second, logged 10 times a second
    50
    >>> auto_stride([0.25, 0.3]), auto_stride([0.03]), auto_stride([])
    (1, 5, 1)
    """
    if not seconds_per_step:
        return 1
    t = statistics.median(seconds_per_step)
    for stride in AUTO_STRIDES:
        if stride * t >= interval_s:
            return stride
    return AUTO_STRIDES[-1]


def throughput(examples: float, seconds: float, num_replicas: int) -> dict[str, float]:
    """``sync/examples_per_sec`` (all replicas) and ``sync/examples_per_sec_per_replica``.

    >>> throughput(640, 2.0, 2)
    {'sync/examples_per_sec': 320.0, 'sync/examples_per_sec_per_replica': 160.0}
    """
    if seconds <= 0 or num_replicas < 1:
        return {}
    rate = examples / seconds
    return {"sync/examples_per_sec": rate, "sync/examples_per_sec_per_replica": rate / num_replicas}


#: The keys of `window_peaks`: each the largest value over the steps since the previous logged point.
WINDOW_KEYS = (
    "sync/window_max/loss",
    "sync/window_max/loss_spread",
    "sync/window_max/grad_norm",
    "sync/window_max/grad_norm_spread",
)


def window_peaks(
    peaks: dict[str, float] | None, losses: Sequence[float], grad_norms: Sequence[float]
) -> dict[str, float]:
    """Fold one step's per-replica values into the peaks of a window of unlogged steps (a new dict),
    so a spike between two logged points still shows (NaN, not measured, is left out).

    >>> p = window_peaks(None, [0.5, 0.7], [1.0, 3.0])
    >>> p = window_peaks(p, [0.4, 9.0], [1.0, 1.0])  # a spike on replica 1
    >>> p["sync/window_max/loss"], p["sync/window_max/loss_spread"], p["sync/window_max/grad_norm"]
    (9.0, 8.6, 3.0)
    """
    out = dict(peaks or {})
    losses = [float(v) for v in losses if not math.isnan(v)]
    norms = [float(v) for v in grad_norms if not math.isnan(v)]
    values = zip(
        WINDOW_KEYS,
        (
            max(losses, default=math.nan),
            loss_spread(losses),
            max(norms, default=math.nan),
            grad_norm_spread(norms),
        ),
    )
    for key, v in values:
        if not math.isnan(v):
            out[key] = max(out.get(key, v), v)
    return out


def replica_metrics(losses: Sequence[float], grad_norms: Sequence[float]) -> dict[str, float]:
    """The per-replica metrics (replica ``i`` of the whole job, worker 0's first; NaN left out),
    plus the loss and grad-norm spreads when every replica measured them.

    >>> replica_metrics([0.5, 0.75], [1.0, 3.0])  # doctest: +NORMALIZE_WHITESPACE
    {'sync/loss/replica_0': 0.5, 'sync/loss/replica_1': 0.75, 'sync/loss_spread': 0.25,
     'sync/grad_norm/replica_0': 1.0, 'sync/grad_norm/replica_1': 3.0, 'sync/grad_norm_spread': 1.0}
    """
    out: dict[str, float] = {}
    for i, v in enumerate(losses):
        if not math.isnan(v):
            out[f"sync/loss/replica_{i}"] = float(v)
    finite_losses = [float(v) for v in losses if not math.isnan(v)]
    if len(finite_losses) == len(losses) and finite_losses:
        out["sync/loss_spread"] = loss_spread(finite_losses)
    finite = [float(v) for v in grad_norms if not math.isnan(v)]
    for i, v in enumerate(grad_norms):
        if not math.isnan(v):
            out[f"sync/grad_norm/replica_{i}"] = float(v)
    if len(finite) == len(grad_norms) and finite:
        out["sync/grad_norm_spread"] = grad_norm_spread(finite)
    return out
