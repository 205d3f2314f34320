"""The data of the sync report, bounded in memory, and its drawing as one PNG.

Pure Python plus matplotlib's object API (the user's pyplot backend is left alone).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import statistics
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from keras_sync.measures.slow_worker import MIN_EXTRA_MS, RATIO, slowest

_PER_INDEX = re.compile(
    r"^sync/(loss|grad_norm)/replica_(\d+)$|^sync/(between_steps|compute)_ms/worker_(\d+)$"
)
_PER_INDEX_NAMES = ("loss", "grad_norm", "between_steps", "compute")
_SINGLE = {
    "sync/grad_norm_spread": "spread",
    "sync/step_time_ms": "step_time_ms",
    "sync/weight_divergence": "divergence",
}
#: What `keras_sync.measures.fingerprints.summarize` measures: not the largest element-wise difference.
DIVERGENCE_TITLE = (
    "weight divergence: largest spread of a variable's mean\n"
    "or RMS, a lower bound of max |w_i - w_j| (0 = same bits)"
)


@dataclasses.dataclass
class Series:
    """Points (step, value) of one metric, at most ``max_points``, evenly spread over the run:
    every ``stride``-th point is kept; when full, every other one goes and the stride doubles.

    >>> s = Series(max_points=4)
    >>> for step in range(1, 11):
    ...     s.add(step, float(step))
    >>> s.steps, s.stride
    ([1, 5, 9], 4)
    """

    max_points: int = 2000
    steps: list[int] = dataclasses.field(default_factory=list)
    values: list[float] = dataclasses.field(default_factory=list)
    stride: int = 1
    offered: int = 0

    def add(self, step: int, value: float) -> None:
        keep = self.offered % self.stride == 0
        self.offered += 1
        if keep and math.isfinite(value):
            self.steps.append(int(step))
            self.values.append(float(value))
            if len(self.steps) > self.max_points:
                self.steps, self.values = self.steps[::2], self.values[::2]
                self.stride *= 2


@dataclasses.dataclass
class SyncHistory:
    """What the report draws: ``loss`` and ``grad_norm`` per replica, times (ms) per worker."""

    max_points: int = 2000
    loss: dict[int, Series] = dataclasses.field(default_factory=dict)
    grad_norm: dict[int, Series] = dataclasses.field(default_factory=dict)
    between_steps: dict[int, Series] = dataclasses.field(default_factory=dict)
    compute: dict[int, Series] = dataclasses.field(default_factory=dict)
    spread: Series = dataclasses.field(init=False)
    step_time_ms: Series = dataclasses.field(init=False)
    divergence: Series = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        for name in _SINGLE.values():
            setattr(self, name, Series(self.max_points))

    def add(self, metrics: Mapping[str, float], step: int) -> None:
        """Keep the sync metrics of one logged step (other keys are ignored)."""
        for key, value in metrics.items():
            if key in _SINGLE:
                getattr(self, _SINGLE[key]).add(step, float(value))
            elif (m := _PER_INDEX.match(key)) is not None:
                name, index = m.group(1) or m.group(3), m.group(2) or m.group(4)
                per: dict[int, Series] = getattr(self, name)
                per.setdefault(int(index), Series(self.max_points)).add(step, float(value))

    @property
    def empty(self) -> bool:
        return not (self.loss or self.grad_norm or self.step_time_ms.steps or self.divergence.steps)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able copy (the courier draws the report from it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SyncHistory:
        """The history `to_dict` gave (JSON turned its replica and worker numbers into strings)."""
        history = cls(max_points=int(data["max_points"]))
        for name in _PER_INDEX_NAMES:
            setattr(history, name, {int(i): Series(**s) for i, s in data.get(name, {}).items()})
        for name in _SINGLE.values():
            setattr(history, name, Series(**data[name]))
        return history

    def slowest_worker(self) -> tuple[int, float, float, float] | None:
        """(worker, median ms between steps, median compute ms, the others' median) of a worker
        that holds the job back (`keras_sync.measures.slow_worker.slowest`), else None."""
        medians = {
            w: [
                statistics.median(s[w].values or [math.nan])
                for s in (self.between_steps, self.compute)
            ]
            for w in sorted(set(self.between_steps) & set(self.compute))
        }
        own = {w: a + b for w, (a, b) in medians.items() if math.isfinite(a + b)}
        found = slowest(list(own.values())) if len(own) >= 2 else None
        if found is None:
            return None
        worst = list(own)[found[0]]
        return worst, medians[worst][0], medians[worst][1], found[2]


def slow_worker_lines(history: SyncHistory) -> list[str]:
    """The summary's lines on the workers' times: the slow worker, or that none is, with the rule."""
    if len(set(history.between_steps) & set(history.compute)) < 2:
        return []
    slow = history.slowest_worker()
    if slow is None:
        return [
            f"no worker is slow: none took over {RATIO:g}x",
            f"  the other workers' median and {MIN_EXTRA_MS:g} ms more",
            "  to reach the all-reduce",
        ]
    w, between, compute, others = slow
    return [
        f"slowest worker: {w}, {between + compute:.3g} ms to the all-reduce",
        f"  ({between:.3g} between steps + compute {compute:.3g};",
        f"  other workers' median {others:.3g} ms)",
    ]


def upload(history: SyncHistory, artifact_file: str, log_file: Callable[[str], Any]) -> None:
    """Draw ``history`` as a temporary ``artifact_file`` and hand its path to ``log_file``; one that
    cannot be drawn is skipped with a warning (the metrics are logged as usual)."""
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        path = os.path.join(tmp, artifact_file)
        try:
            draw(history).savefig(path, format="png")
        except Exception as e:
            message = f"keras-sync could not draw {artifact_file} ({type(e).__name__}: {e})."
            logging.getLogger("keras_sync").warning(message)
            return
        log_file(path)


def draw(history: SyncHistory, *, title: str = "keras-sync: sync health") -> Any:
    """The report as a matplotlib `Figure` of 2x2 panels (not saved; no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8.5), dpi=100)
    FigureCanvasAgg(fig)
    (loss, grad), (divergence, summary) = fig.subplots(2, 2)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.07, top=0.91, wspace=0.2, hspace=0.35)
    charts = [
        (loss, history.loss, "loss per replica (before the all-reduce)", None),
        (grad, history.grad_norm, "gradient norm per replica", None),
        (divergence, {-1: history.divergence}, DIVERGENCE_TITLE, "spread (the weights' units)"),
    ]
    for ax, lines, what, unit in charts:
        for i, s in sorted(lines.items()):
            ax.plot(s.steps, s.values, label=f"replica {i}", linewidth=1.0, marker=unit and ".")
        if 1 < len(lines) <= 16:
            ax.legend(loc="upper right", fontsize="small")
        if not any(s.steps for s in lines.values()):
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=what, xlabel="optimizer step", ylabel=unit or "")
    summary.axis("off")
    text = "\n".join(_summary(history))
    summary.text(0.0, 1.0, text, transform=summary.transAxes, va="top", family="monospace")
    fig.suptitle(title)
    return fig


def _summary(history: SyncHistory) -> list[str]:
    replicas = set(history.loss) | set(history.grad_norm)
    lines = [f"replicas: {len(replicas) or 'unknown'}"]
    times, spread = sorted(history.step_time_ms.values), sorted(history.spread.values)
    if times:
        p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
        lines.append(f"step time: median {times[len(times) // 2]:.3g} ms, p95 {p95:.3g} ms")
        lines.append(f"  slowest {times[-1]:.4g} ms")
    if spread:
        median, top = spread[len(spread) // 2], spread[-1]
        lines.append(f"grad-norm spread: median {median:.3g}, max {top:.3g}")
        lines.append("  (max - min) / mean of the replicas' norms")
    lines += slow_worker_lines(history)
    if history.divergence.values:
        worst = max(history.divergence.values)
        state = "(in sync)" if worst == 0 else "(replicas DIFFER)"
        lines.append(f"weight divergence: max {worst:.3g} {state}")
    return lines
