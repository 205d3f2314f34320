"""Which worker is slow: per-worker times (between steps, and compute up to the all-reduce,
from `training.instrument`) and the rule that names the slowest."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

#: A worker holds the job back when its time to the all-reduce is over RATIO times the others'
#: median and MIN_EXTRA_MS more, at every logged step for HOLD_S s: one line on the chief, once.
RATIO = 1.5
MIN_EXTRA_MS = 5.0
HOLD_S = 60.0

BETWEEN_KEY = "sync/between_steps_ms/worker_{i}"
COMPUTE_KEY = "sync/compute_ms/worker_{i}"


def worker_times(
    between_us: Sequence[float], computes_us: Sequence[float], num_workers: int
) -> dict[str, float]:
    """`BETWEEN_KEY` and `COMPUTE_KEY` per worker (ms): its replicas' largest time (us; < 0: none)."""
    out: dict[str, float] = {}
    per = len(between_us) // num_workers
    for w in range(num_workers):
        for key, times in ((BETWEEN_KEY, between_us), (COMPUTE_KEY, computes_us)):
            measured = [v for v in times[w * per : (w + 1) * per] if v >= 0]
            if measured:
                out[key.format(i=w)] = max(measured) / 1000.0
    return out


def own_times(metrics: dict[str, float], num_workers: int) -> list[float]:
    """Each worker's own time per step (between steps + compute, ms; NaN if a part is missing)."""
    return [
        metrics.get(BETWEEN_KEY.format(i=w), math.nan)
        + metrics.get(COMPUTE_KEY.format(i=w), math.nan)
        for w in range(num_workers)
    ]


def slowest(own_ms: Sequence[float]) -> tuple[int, float, float] | None:
    """(worker, its time, the other workers' median) when one worker holds the job back, else None.

    >>> slowest([3.0, 205.0, 2.5]), slowest([3.0, 4.0, 3.5]), slowest([0.1, 0.9, 0.2])
    ((1, 205.0, 2.75), None, None)
    """
    if len(own_ms) < 2 or not all(math.isfinite(t) for t in own_ms):
        return None
    worst = max(range(len(own_ms)), key=lambda w: own_ms[w])
    others = statistics.median([v for w, v in enumerate(own_ms) if w != worst])
    t = own_ms[worst]
    return (worst, t, others) if t > RATIO * others and t - others >= MIN_EXTRA_MS else None


class SlowWorkerWatch:
    """Says once when the same worker has held the job back at every logged step for `HOLD_S` s."""

    def __init__(self, hold_s: float | None = None):
        self.hold_s = HOLD_S if hold_s is None else hold_s  # read late: a test sets HOLD_S
        self._worker: int | None = None
        self._since, self.said = 0.0, False

    def update(
        self, own_ms: Sequence[float], between_ms: Sequence[float], t_s: float
    ) -> str | None:
        """One logged step: each worker's own and between-steps times (ms), the wall time (s)."""
        found = slowest(own_ms)
        if found is None or found[0] != self._worker:
            self._worker, self._since = (found[0] if found else None), t_s
            return None
        if self.said or t_s - self._since < self.hold_s:
            return None
        self.said = True
        w, t, median = found
        return (
            f"keras-sync: worker {w} holds the job back: for {t_s - self._since:.0f} s it took "
            f"{t:.0f} ms a step to reach the gradient all-reduce ({between_ms[w]:.0f} ms between "
            f"steps, compute {t - between_ms[w]:.0f} ms) against the other workers' median of "
            f"{median:.0f} ms, and they wait for it. Its times are {BETWEEN_KEY.format(i=w)} and "
            f"{COMPUTE_KEY.format(i=w)} in MLflow."
        )
