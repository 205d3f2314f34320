"""Pure logic of the sync callbacks: spreads, throughput, when to log, the writer check."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from keras_sync.errors import UsageError

#: `log_every_n_steps: auto`: the smallest stride whose steps take `AUTO_INTERVAL_S` (round numbers).
AUTO_STRIDES = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
AUTO_INTERVAL_S = 0.1
#: The keys of `window_peaks`: each the largest value over the steps since the last logged point.
WINDOW_KEYS = (
    "sync/window_max/loss",
    "sync/window_max/loss_spread",
    "sync/window_max/grad_norm",
    "sync/window_max/grad_norm_spread",
)


def check_writer(writer: Any, method: str) -> None:
    """Raise `UsageError` unless ``writer`` is None or has ``method`` (a callback's `writer`)."""
    if writer is not None and not hasattr(writer, method):
        raise UsageError(
            f"Invalid value for argument `writer`. Received: writer={writer!r}, which has no "
            f"`{method}`. Expected a keras_sync.tracking.MlflowWriter or another object with the "
            "methods of keras_sync.tracking.Writer, or None on workers that do not write."
        )


def grad_norm_spread(norms: Sequence[float]) -> float:
    """How unequal the replicas' gradient norms are: ``(max - min) / mean`` (NaN if the mean is 0)."""
    mean = sum(norms) / len(norms) if norms else math.nan
    return (max(norms) - min(norms)) / mean if mean and math.isfinite(mean) else math.nan


def loss_spread(losses: Sequence[float]) -> float:
    """How far apart the replicas' losses are: ``max - min``, absolute (a loss falls towards 0)."""
    return max(losses) - min(losses) if losses else math.nan


def crossed_log_step(prev_step: int, step: int, every: int) -> bool:
    """True when the global step moved past a multiple of ``every`` (several steps per call too)."""
    return step // every > prev_step // every


def auto_stride(seconds_per_step: list[float], interval_s: float = AUTO_INTERVAL_S) -> int:
    """The stride of ``log_every_n_steps: auto``, from the median time per step.

    >>> auto_stride([0.002] * 31 + [4.0]), auto_stride([0.25, 0.3]), auto_stride([])
    (50, 1, 1)
    """
    if not seconds_per_step:
        return 1
    t = statistics.median(seconds_per_step)
    return next((s for s in AUTO_STRIDES if s * t >= interval_s), AUTO_STRIDES[-1])


def throughput(examples: float, seconds: float, num_replicas: int) -> dict[str, float]:
    """``sync/examples_per_sec`` (all replicas) and ``sync/examples_per_sec_per_replica``."""
    if seconds <= 0 or num_replicas < 1:
        return {}
    rate = examples / seconds
    return {"sync/examples_per_sec": rate, "sync/examples_per_sec_per_replica": rate / num_replicas}


def window_peaks(
    peaks: dict[str, float] | None, losses: Sequence[float], grad_norms: Sequence[float]
) -> dict[str, float]:
    """Fold one step's per-replica values (NaN left out) into a new dict of the unlogged peaks."""
    losses = [float(v) for v in losses if not math.isnan(v)]
    norms = [float(v) for v in grad_norms if not math.isnan(v)]
    values = [max(losses, default=math.nan), loss_spread(losses)]
    values += [max(norms, default=math.nan), grad_norm_spread(norms)]
    out = dict(peaks or {})
    for key, v in zip(WINDOW_KEYS, values):
        if not math.isnan(v):
            out[key] = max(out.get(key, v), v)
    return out


def replica_metrics(losses: Sequence[float], grad_norms: Sequence[float]) -> dict[str, float]:
    """The per-replica metrics (NaN left out), and the spreads when every replica measured them."""
    loss = {i: float(v) for i, v in enumerate(losses) if not math.isnan(v)}
    norm = {i: float(v) for i, v in enumerate(grad_norms) if not math.isnan(v)}
    out = {f"sync/loss/replica_{i}": v for i, v in loss.items()}
    if loss and len(loss) == len(losses):
        out["sync/loss_spread"] = loss_spread(list(loss.values()))
    out.update({f"sync/grad_norm/replica_{i}": v for i, v in norm.items()})
    if norm and len(norm) == len(grad_norms):
        out["sync/grad_norm_spread"] = grad_norm_spread(list(norm.values()))
    return out
