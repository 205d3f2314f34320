"""keras_sync.tracking.deliver: spooled records reach MLflow through its public client only.

In-process against a real sqlite store, on every supported MLflow (compat lanes).
"""

from __future__ import annotations

import pytest

from keras_sync.tracking.deliver import RunSender
from keras_sync.tracking.records import BEGIN, METRICS, PARAMS

pytestmark = pytest.mark.compat


def test_the_courier_sends_metric_batches_and_params_through_log_batch(tmp_path):
    sender = RunSender(f"sqlite:///{tmp_path / 'c.db'}", "exp", None, "job-1")
    points = [
        {
            "k": METRICS,
            "s": s,
            "ts": 1_700_000_000_000 + s,
            "d": {"loss": 1.0 / (s + 1), "acc": s / 10},
        }
        for s in range(30)
    ]
    assert sender.send([{"k": BEGIN, "ts": 1_700_000_000_000}, *points]) == 60
    assert sender.points_sent == 60
    # Params ride in the same batch as the points beside them.
    last = {"k": METRICS, "s": 30, "ts": 1_700_000_000_030, "d": {"loss": 0.1}}
    assert sender.send([{"k": PARAMS, "d": {"lr": "0.1"}}, last]) == 1 and sender.points_sent == 61
    run = sender.client().get_run(sender.run_id)
    assert run.data.params == {"lr": "0.1"} and run.data.metrics == {"loss": 0.1, "acc": 2.9}
    assert [m.step for m in sender.client().get_metric_history(sender.run_id, "acc")] == list(
        range(30)
    )


def test_a_new_courier_drops_the_steps_the_run_already_has(tmp_path):
    """The highest step of each key is read back through the public metric histories."""
    uri = f"sqlite:///{tmp_path / 'c.db'}"
    first = RunSender(uri, "exp", None, "job-1")
    rec = [
        {"k": METRICS, "s": s, "ts": 1_700_000_000_000 + s, "d": {"loss": 1.0}} for s in range(5)
    ]
    assert first.send([{"k": BEGIN, "ts": 1_700_000_000_000}, *rec]) == 5
    again = RunSender(uri, "exp", None, "job-1")
    more = [
        {"k": METRICS, "s": s, "ts": 1_700_000_001_000, "d": {"loss": 2.0}} for s in range(3, 8)
    ]
    assert again.send([{"k": BEGIN, "ts": 1_700_000_000_000}, *more]) == 3
    assert again.run_id == first.run_id and again.dropped == 2
    history = again.client().get_metric_history(again.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(8))
