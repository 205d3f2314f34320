"""`sync_report.png`: the bounded history it draws (no TensorFlow), its drawing, its errors, and the
artifact of real runs (fixture `autolog_runs` in conftest.py, shared with test_model_logging.py)."""

from __future__ import annotations

import doctest
import math
import sys

import pytest

from keras_sync.tracking import report_plot as _sync_plot
from keras_sync.tracking.report_plot import Series, SyncHistory

# The shared TensorFlow runs take 5-15 minutes on a shared 2-core machine (the first test pays for them).
pytestmark = pytest.mark.timeout(2400)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_sync_plot_doctests():
    assert doctest.testmod(_sync_plot).failed == 0


def test_series_stays_bounded_and_evenly_spread_over_a_long_run():
    s = Series(max_points=100)
    for step in range(1, 100_001):
        s.add(step, math.sin(step))
    assert 50 <= len(s.steps) <= 100
    gaps = {b - a for a, b in zip(s.steps, s.steps[1:])}
    assert gaps == {s.stride} and s.steps[0] == 1 and s.steps[-1] > 100_000 - 2 * s.stride


def test_history_keeps_only_the_sync_metrics_and_skips_non_finite_values():
    h = SyncHistory(max_points=10)
    assert h.empty
    h.add(
        {
            "sync/loss/replica_0": 1.0,
            "sync/loss/replica_1": 2.0,
            "sync/grad_norm/replica_1": 3.0,
            "sync/grad_norm_spread": float("nan"),
            "sync/step_time_ms": 5.0,
            "loss": 9.0,
            "sync/learning_rate": 0.1,
        },
        4,
    )
    h.add({"sync/weight_divergence": 0.0}, 8)
    assert (h.loss[0].values, h.loss[1].values, h.grad_norm[1].values) == ([1.0], [2.0], [3.0])
    assert 0 not in h.grad_norm and h.spread.steps == [] and h.step_time_ms.steps == [4]
    assert h.divergence.steps == [8] and not h.empty


def test_history_goes_through_json_to_the_courier_unchanged():
    import json

    h = SyncHistory(max_points=4)
    for step in range(1, 12):
        h.add(
            {
                "sync/loss/replica_0": 1 / step,
                "sync/grad_norm/replica_3": float(step),
                "sync/step_time_ms": 2.0,
            },
            step,
        )
    h.add({"sync/weight_divergence": 0.5, "sync/grad_norm_spread": 0.1}, 12)
    back = SyncHistory.from_dict(json.loads(json.dumps(h.to_dict())))
    assert (
        back == h and back.loss[0].stride == h.loss[0].stride > 1
    )  # thinned state kept: it goes on thinning alike
    assert SyncHistory.from_dict(SyncHistory().to_dict()).empty


def render(history, path):
    _sync_plot.draw(history).savefig(path, format="png")  # as the courier's upload does


def test_the_report_draws_a_png_without_touching_the_pyplot_backend(tmp_path):
    h = SyncHistory(max_points=50)
    for step in range(1, 400):
        h.add(
            {
                "sync/loss/replica_0": 1 / step,
                "sync/loss/replica_1": 1.1 / step,
                "sync/grad_norm/replica_0": 2.0,
                "sync/grad_norm/replica_1": 2.5,
                "sync/grad_norm_spread": 0.22,
                "sync/step_time_ms": 5000.0 if step == 1 else 10.0 + step % 3,
            },
            step,
        )
    h.add({"sync/weight_divergence": 0.0}, 399)
    had_pyplot = "matplotlib.pyplot" in sys.modules
    render(SyncHistory(), tmp_path / "empty.png")  # nothing measured: every chart says so
    assert (
        "matplotlib.pyplot" in sys.modules
    ) == had_pyplot  # no pyplot: the user's backend is left alone
    render(h, tmp_path / "r.png")
    data = (tmp_path / "r.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    assert (tmp_path / "empty.png").read_bytes().startswith(PNG_MAGIC)


# ---- TensorFlow ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_sync_report_arguments_are_checked():
    from keras_sync.callbacks.sync_report import SyncReport
    from keras_sync.errors import UsageError

    with pytest.raises(
        UsageError,
        match=r"^Invalid value for argument `when`\. Received: when='always'\. "
        r"Expected one of 'end', 'epoch'\.$",
    ):
        SyncReport(None, when="always")
    with pytest.raises(
        UsageError,
        match=r"^Invalid value for argument `max_points`\. Received: max_points=1\. "
        r"Expected an integer >= 2\.$",
    ):
        SyncReport(None, max_points=1)
    with pytest.raises(
        UsageError,
        match=r"^Invalid value for argument `writer`\. Received: writer='w', "
        r"which has no `log_artifact_file`\.",
    ):
        SyncReport("w")


def _png(client, run_id, dst):
    from pathlib import Path

    return Path(client.download_artifacts(run_id, "sync_report.png", str(dst))).read_bytes()


@pytest.mark.slow
def test_runs_carry_the_report_as_configured(autolog_runs):
    from mlflow import MlflowClient

    c = MlflowClient(autolog_runs["sqlite"])
    logged = autolog_runs["mirrored"]["logged"]["run_id"]
    png = _png(c, logged, autolog_runs["out"] / "dl-report")
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000
    compiled = autolog_runs["mirrored"]["compiled"]["run_id"]  # sync_report: off
    assert "sync_report.png" not in [a.path for a in c.list_artifacts(compiled)]
    auto = autolog_runs["mirrored"]["autolog"]["run_id"]  # the default: end
    assert _png(c, auto, autolog_runs["out"] / "dl-auto").startswith(PNG_MAGIC)
    mw = MlflowClient(
        autolog_runs["mw_sqlite"]
    )  # multi-worker: the chief drew both workers' replicas
    assert _png(
        mw, autolog_runs["multi_worker"]["run_id"], autolog_runs["out"] / "dl-mw"
    ).startswith(PNG_MAGIC)


@pytest.mark.slow
def test_report_draws_every_replica_of_the_run(autolog_runs, tmp_path):
    """Redraw the run's report from its MLflow metrics: the PNG the callback logged is the same picture."""
    from mlflow import MlflowClient

    c = MlflowClient(autolog_runs["sqlite"])
    run_id = autolog_runs["mirrored"]["logged"]["run_id"]
    h = SyncHistory()
    keys = [
        "sync/loss/replica_0",
        "sync/loss/replica_1",
        "sync/grad_norm/replica_0",
        "sync/grad_norm/replica_1",
        "sync/grad_norm_spread",
        "sync/step_time_ms",
        "sync/weight_divergence",
    ]
    points = sorted((m.step, k, m.value) for k in keys for m in c.get_metric_history(run_id, k))
    for step, key, value in points:
        h.add({key: value}, step)
    assert sorted(h.loss) == [0, 1] and h.loss[1].steps == list(range(1, 25))
    assert h.divergence.steps == [8, 16, 24] and set(h.divergence.values) == {0.0}
    render(h, tmp_path / "again.png")
    logged = _png(c, run_id, tmp_path / "dl")
    assert logged == (tmp_path / "again.png").read_bytes()


def test_report_names_the_slowest_worker_and_says_what_the_divergence_number_is():
    h = SyncHistory()
    for step in range(1, 30):
        h.add(
            {
                "sync/loss/replica_0": 1.0,
                "sync/loss/replica_1": 1.0,
                "sync/loss/replica_2": 1.0,
                "sync/between_steps_ms/worker_0": 1.0,
                "sync/compute_ms/worker_0": 2.0,
                "sync/between_steps_ms/worker_1": 201.0,
                "sync/compute_ms/worker_1": 2.0,
                "sync/between_steps_ms/worker_2": 1.5,
                "sync/compute_ms/worker_2": 2.5,
                "sync/step_time_ms": 210.0,
            },
            step,
        )
    h.add({"sync/weight_divergence": 0.0}, 29)
    fig = _sync_plot.draw(h)
    titles = [ax.get_title() for ax in fig.axes]
    # The number is the largest spread of a variable's mean or RMS (_fingerprints.summarize), not
    # the largest element-wise difference it bounds from below.
    assert (
        "weight divergence: largest spread of a variable's mean\nor RMS, a lower bound of max |w_i - w_j| "
        "(0 = same bits)"
    ) in titles
    summary = "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert (
        "slowest worker: 1, 203 ms to the all-reduce\n  (201 between steps + compute 2;\n  other workers' median 3.5 ms)"
        in summary
    ), summary
    even = (
        SyncHistory()
    )  # issue 41 item 7: 4 us apart next to a 27.5 ms step is noise, not a slow worker
    for step in range(1, 30):
        even.add(
            {
                "sync/between_steps_ms/worker_0": 0.1,
                "sync/compute_ms/worker_0": 0.048,
                "sync/between_steps_ms/worker_1": 0.1,
                "sync/compute_ms/worker_1": 0.052,
                "sync/step_time_ms": 27.5,
            },
            step,
        )
    text = "\n".join(t.get_text() for ax in _sync_plot.draw(even).axes for t in ax.texts)
    assert (
        "slowest worker" not in text
        and (
            "no worker is slow: none took over 1.5x\n  the other workers' median "
            "and 5 ms more\n  to reach the all-reduce"
        )
        in text
    ), text
    one = SyncHistory()  # one worker: nothing to name
    one.add({"sync/loss/replica_0": 1.0, "sync/step_time_ms": 3.0}, 1)
    assert "slowest worker" not in "\n".join(
        t.get_text() for ax in _sync_plot.draw(one).axes for t in ax.texts
    )
