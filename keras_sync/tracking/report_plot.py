"""The data of the sync report, kept bounded in memory, and its drawing as one PNG.

Pure Python plus matplotlib (imported when drawing, through its object API: the user's pyplot
backend is left alone); no TensorFlow, Keras or MLflow, so it is tested on its own.
"""

from __future__ import annotations

import math
import os
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_REPLICA_KEY = re.compile(r"^sync/(loss|grad_norm)/replica_(\d+)$")
_WORKER_KEY = re.compile(r"^sync/(between_steps_ms|compute_ms)/worker_(\d+)$")
SPREAD = "sync/grad_norm_spread"
STEP_TIME = "sync/step_time_ms"
DIVERGENCE = "sync/weight_divergence"
#: What `keras_sync.measures.fingerprints.summarize` measures: not the largest element-wise difference.
DIVERGENCE_TITLE = (
    "weight divergence: largest spread of a variable's mean\n"
    "or RMS, a lower bound of max |w_i - w_j| (0 = same bits)"
)


@dataclass
class Series:
    """Points (step, value) of one metric, at most ``max_points`` of them however long the run.

    Every ``stride``-th point offered is kept; when the series is full, every other kept point
    is dropped and the stride doubles, so the points stay evenly spread over the whole run.

    >>> s = Series(max_points=4)
    >>> for step in range(1, 11):
    ...     s.add(step, float(step))
    >>> s.steps, s.stride
    ([1, 5, 9], 4)
    """

    max_points: int = 2000
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    stride: int = 1
    offered: int = 0

    def add(self, step: int, value: float) -> None:
        keep = self.offered % self.stride == 0
        self.offered += 1
        if not keep or not math.isfinite(value):
            return
        self.steps.append(int(step))
        self.values.append(float(value))
        if len(self.steps) > self.max_points:
            self.steps, self.values = self.steps[::2], self.values[::2]
            self.stride *= 2


@dataclass
class SyncHistory:
    """What the report draws, fed with the metric dicts the sync callbacks log."""

    max_points: int = 2000
    loss: dict[int, Series] = field(default_factory=dict)
    grad_norm: dict[int, Series] = field(default_factory=dict)
    #: Per worker (2 or more): its time between steps and its compute, ms.
    between_steps: dict[int, Series] = field(default_factory=dict)
    compute: dict[int, Series] = field(default_factory=dict)
    spread: Series = field(init=False)
    step_time_ms: Series = field(init=False)
    divergence: Series = field(init=False)

    def __post_init__(self) -> None:
        self.spread, self.step_time_ms, self.divergence = (
            Series(self.max_points) for _ in range(3)
        )

    def add(self, metrics: Mapping[str, float], step: int) -> None:
        """Keep the sync metrics of one logged step (other keys are ignored)."""
        for key, value in metrics.items():
            m = _REPLICA_KEY.match(key)
            if m is not None:
                target = self.loss if m.group(1) == "loss" else self.grad_norm
                target.setdefault(int(m.group(2)), Series(self.max_points)).add(step, float(value))
            elif (w := _WORKER_KEY.match(key)) is not None:
                target = self.between_steps if w.group(1) == "between_steps_ms" else self.compute
                target.setdefault(int(w.group(2)), Series(self.max_points)).add(step, float(value))
            elif key == SPREAD:
                self.spread.add(step, float(value))
            elif key == STEP_TIME:
                self.step_time_ms.add(step, float(value))
            elif key == DIVERGENCE:
                self.divergence.add(step, float(value))

    @property
    def empty(self) -> bool:
        return not (self.loss or self.grad_norm or self.step_time_ms.steps or self.divergence.steps)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able copy (the courier draws the report from it: `keras_sync.tracking`)."""

        def series(x: Series) -> dict[str, Any]:
            return {
                "max_points": x.max_points,
                "steps": list(x.steps),
                "values": list(x.values),
                "stride": x.stride,
                "offered": x.offered,
            }

        return {
            "max_points": self.max_points,
            "loss": {str(r): series(x) for r, x in self.loss.items()},
            "grad_norm": {str(r): series(x) for r, x in self.grad_norm.items()},
            "between_steps": {str(w): series(x) for w, x in self.between_steps.items()},
            "compute": {str(w): series(x) for w, x in self.compute.items()},
            "spread": series(self.spread),
            "step_time_ms": series(self.step_time_ms),
            "divergence": series(self.divergence),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SyncHistory:
        """The history `to_dict` gave."""
        history = cls(max_points=int(data["max_points"]))
        history.loss = {int(r): Series(**x) for r, x in data["loss"].items()}
        history.grad_norm = {int(r): Series(**x) for r, x in data["grad_norm"].items()}
        history.between_steps = {
            int(w): Series(**x) for w, x in data.get("between_steps", {}).items()
        }
        history.compute = {int(w): Series(**x) for w, x in data.get("compute", {}).items()}
        history.spread, history.step_time_ms, history.divergence = (
            Series(**data[k]) for k in ("spread", "step_time_ms", "divergence")
        )
        return history

    def slowest_worker(self) -> tuple[int, float, float, float] | None:
        """(worker, its median time between steps, its median compute, the other workers' median of the sum),
        all ms, for a worker that holds the job back by the rule of `keras_sync.measures.slow_worker.slowest`
        (over 1.5x the others' median and at least 5 ms more); None when no worker does, or with < 2 workers.

        >>> h = SyncHistory()
        >>> for step in range(1, 4):
        ...     h.add({"sync/between_steps_ms/worker_0": 1.0, "sync/compute_ms/worker_0": 2.0,
        ...            "sync/between_steps_ms/worker_1": 200.0, "sync/compute_ms/worker_1": 2.5}, step)
        >>> h.slowest_worker()
        (1, 200.0, 2.5, 3.0)
        >>> even = SyncHistory()
        >>> even.add({"sync/between_steps_ms/worker_0": 1.0, "sync/compute_ms/worker_0": 2.0,
        ...           "sync/between_steps_ms/worker_1": 1.1, "sync/compute_ms/worker_1": 2.0}, 1)
        >>> print(even.slowest_worker())  # 3.1 ms against 3.0: noise, not a slow worker
        None
        """
        from keras_sync.measures.slow_worker import slowest

        workers = sorted(set(self.between_steps) & set(self.compute))
        if len(workers) < 2:
            return None
        parts = {
            w: (
                statistics.median(self.between_steps[w].values or [math.nan]),
                statistics.median(self.compute[w].values or [math.nan]),
            )
            for w in workers
        }
        own = {w: a + b for w, (a, b) in parts.items() if math.isfinite(a + b)}
        if len(own) < 2:
            return None
        order = list(own)
        found = slowest([own[w] for w in order])
        if found is None:
            return None
        worst = order[found[0]]
        return worst, parts[worst][0], parts[worst][1], found[2]

    def has_worker_times(self) -> bool:
        """Whether two or more workers' times were logged (then the summary says which is slow, or that none is)."""
        return len(set(self.between_steps) & set(self.compute)) >= 2


def render(
    history: SyncHistory, path: str | os.PathLike[str], *, title: str = "keras-sync: sync health"
) -> None:
    """Draw ``history`` as a 2x3 grid of charts into the PNG file ``path``."""
    draw(history, title=title).savefig(path, format="png")


def draw(history: SyncHistory, *, title: str = "keras-sync: sync health") -> Any:
    """The report as a matplotlib `Figure` (not saved; no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 8.5), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    fig.subplots_adjust(
        left=0.05, right=0.98, bottom=0.07, top=0.91, wspace=0.25, hspace=0.35
    )  # fixed: cheap
    replicas = sorted(set(history.loss) | set(history.grad_norm))
    _per_replica(
        axes[0][0], history.loss, replicas, "loss per replica (before the all-reduce)", log_y=False
    )
    _per_replica(axes[0][1], history.grad_norm, replicas, "gradient norm per replica", log_y=True)
    _line(axes[0][2], history.spread, "grad-norm spread: (max - min) / mean", "spread")
    ax = axes[1][0]
    times = history.step_time_ms.values
    if times:
        median = sorted(times)[len(times) // 2]
        # The first step of a fit includes tracing (seconds): drawn, it would squeeze the rest into one bar.
        usual = [t for t in times if t <= 10 * median]
        slow = [t for t in times if t > 10 * median]
        ax.hist(usual, bins=min(50, max(5, len(usual) // 4)), color="tab:blue", alpha=0.8)
        ax.axvline(median, color="black", linestyle="--", label=f"median {median:.3g} ms")
        if slow:
            ax.plot(
                [],
                [],
                " ",
                label=f"{len(slow)} step(s) > 10x median not drawn (max {max(slow):.4g} ms)",
            )
        ax.legend(loc="upper right", fontsize="small")
    else:
        _no_data(ax)
    ax.set_title("step time distribution")
    ax.set_xlabel("ms per step")
    ax.set_ylabel("logged steps")
    _line(
        axes[1][1], history.divergence, DIVERGENCE_TITLE, "spread (the weights' units)", marker="o"
    )
    _summary(axes[1][2], history, replicas)
    fig.suptitle(title)
    return fig


def _per_replica(
    ax, series: Mapping[int, Series], replicas: list[int], title: str, *, log_y: bool
) -> None:
    shown = [(r, series[r]) for r in replicas if r in series and series[r].steps]
    for r, s in shown:
        ax.plot(s.steps, s.values, label=f"replica {r}", linewidth=1.0, alpha=0.75)
    if not shown:
        _no_data(ax)
    elif len(shown) <= 16:
        ax.legend(loc="upper right", fontsize="small", ncol=2 if len(shown) > 8 else 1)
    if log_y and shown and all(v > 0 for _, s in shown for v in s.values):
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel("optimizer step")


def _line(ax, s: Series, title: str, ylabel: str, *, marker: str | None = None) -> None:
    if s.steps:
        ax.plot(s.steps, s.values, color="tab:red", linewidth=1.0, marker=marker)
    else:
        _no_data(ax)
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)


def _no_data(ax) -> None:
    ax.text(
        0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="gray"
    )


def _summary(ax, history: SyncHistory, replicas: list[int]) -> None:
    ax.axis("off")
    lines = [f"replicas: {len(replicas) or 'unknown'}"]
    steps = [s.steps[-1] for s in history.loss.values() if s.steps] + history.step_time_ms.steps[
        -1:
    ]
    if steps:
        lines.append(f"last logged step: {max(steps)}")
    strides = {s.stride for s in (*history.loss.values(), history.step_time_ms) if s.steps}
    if strides and max(strides) > 1:
        lines.append(f"downsampled: 1 logged step in {max(strides)} drawn")
    if history.spread.values:
        lines.append(
            f"grad-norm spread: median {sorted(history.spread.values)[len(history.spread.values) // 2]:.3g}, "
            f"max {max(history.spread.values):.3g}"
        )
    if history.step_time_ms.values:
        t = sorted(history.step_time_ms.values)
        lines.append(
            f"step time: median {t[len(t) // 2]:.3g} ms, p95 {t[min(len(t) - 1, int(0.95 * len(t)))]:.3g} ms"
        )
    lines += slow_worker_lines(history)
    if history.divergence.values:
        worst = max(history.divergence.values)
        lines.append(
            f"weight divergence: max {worst:.3g} "
            + ("(in sync)" if worst == 0 else "(replicas DIFFER)")
        )
    ax.text(
        0.0,
        1.0,
        "\n".join(lines),
        va="top",
        ha="left",
        family="monospace",
        fontsize="medium",
        transform=ax.transAxes,
    )


def slow_worker_lines(history: SyncHistory) -> list[str]:
    """The summary's lines on the workers' times: the slow worker, or that none is, with the rule.

    >>> h = SyncHistory()
    >>> h.add({"sync/between_steps_ms/worker_0": 0.1, "sync/compute_ms/worker_0": 0.048,
    ...        "sync/between_steps_ms/worker_1": 0.1, "sync/compute_ms/worker_1": 0.052}, 1)
    >>> print("\\n".join(slow_worker_lines(h)))
    no worker is slow: none took over 1.5x
      the other workers' median and 5 ms more
      to reach the all-reduce
    """
    from keras_sync.measures.slow_worker import MIN_EXTRA_MS, RATIO

    if not history.has_worker_times():
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
