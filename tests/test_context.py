"""The callbacks' shared state and run facts (keras_sync/training/context.py): no TensorFlow."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from keras_sync.callbacks import RunContext, SharedState
from keras_sync.errors import UsageError
from keras_sync.training.context import check_shared


def test_a_flush_runs_every_flusher_once_in_the_order_given():
    shared, calls = SharedState(), []

    def first():
        calls.append("first")

    def second():
        calls.append("second")

    shared.add_flusher(first)
    shared.add_flusher(second)
    shared.add_flusher(first)  # registered twice (two set_model calls): still flushed once
    shared.flush()
    assert calls == ["first", "second"]


def test_listeners_see_every_recorded_point():
    shared, seen = SharedState(), []
    shared.add_listener(lambda metrics, step: seen.append((step, dict(metrics))))
    shared.record({"sync/loss_spread": 0.5}, 3)
    shared.record({"sync/weight_divergence": 0.0}, 8)
    assert seen == [(3, {"sync/loss_spread": 0.5}), (8, {"sync/weight_divergence": 0.0})]


def test_check_shared_makes_one_for_none_and_refuses_anything_else():
    assert isinstance(check_shared(None), SharedState)
    s = SharedState()
    assert check_shared(s) is s
    with pytest.raises(
        UsageError, match=r"Invalid value for argument `shared`. Received: shared=dict"
    ):
        check_shared({})


def test_the_run_context_is_frozen_and_gives_the_sync_params():
    ctx = RunContext(
        kind="mirrored",
        num_replicas=2,
        per_replica_batch_size=16,
        global_batch_size=32,
        effective_batch_size=32,
        base_learning_rate=0.1,
        learning_rate=0.2,
        lr_scaling="linear",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.num_replicas = 4  # type: ignore[misc]
    params = ctx.params()
    assert params["sync.strategy"] == "mirrored" and params["sync.global_batch_size"] == 32
    assert params["sync.learning_rate"] == 0.2 and params["sync.warmup_steps"] == 0


def test_the_context_of_a_sync_follows_its_batch_and_data():
    import keras_sync

    sync = keras_sync.load(
        {
            "strategy": {"kind": "default"},
            "batch": {"per_replica": 8},
            "learning_rate": {"base": 0.1, "warmup_epochs": 1},
            "mlflow": {"enabled": False},
        }
    )
    ctx = sync.context()
    assert (ctx.kind, ctx.num_replicas, ctx.global_batch_size) == ("default", 1, 8)
    assert ctx.warmup_steps == "unknown" and ctx.steps_per_epoch is None  # no data seen yet
    assert ctx.config is sync.config
    assert sync.context(per_replica_batch_size=4).global_batch_size == 4


def test_importing_the_callbacks_package_loads_no_tensorflow():
    code = "import keras_sync.callbacks, sys; print('tensorflow' in sys.modules, 'keras' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "False"], r.stderr


def test_each_fit_of_a_job_continues_after_the_last_step_of_the_fit_before():
    from keras_sync.training.context import JobState

    job = JobState()
    first = job.next_fit()
    assert (first.fit, first.job_step(0)) == (1, 0)
    first.step = 16  # 16 steps trained
    again = job.next_fit()  # the same model fitted again: its own count continues
    assert (again.fit, again.job_step(16)) == (2, 16)
    again.step = 32
    new = job.next_fit()  # a new model: after step 32
    assert (new.fit, new.job_step(0), new.job_step(7)) == (3, 32, 39)
    resumed = job.next_fit()
    resumed.step_offset = 16  # a backup restore fixed it: the model's step 10 is the job's 26
    assert resumed.job_step(10) == 26


def test_a_later_fit_sends_only_changed_params_under_its_fit_number():
    from keras_sync.training.context import JobState

    job = JobState()
    assert job.next_fit().params_to_log(
        {"epochs": 1, "optimizer_name": "sgd", "steps_per_epoch": None}
    ) == {
        "epochs": 1,
        "optimizer_name": "sgd",
        "steps_per_epoch": None,
    }  # values as given; compared as MLflow's text
    assert job.next_fit().params_to_log({"epochs": 1, "optimizer_name": "sgd_1"}) == {
        "fit_2.optimizer_name": "sgd_1"
    }
    third = job.next_fit()
    assert third.params_to_log({"epochs": 2, "optimizer_name": "sgd", "new": 5}) == {
        "fit_3.epochs": 2,
        "new": 5,
    }
    assert third.params_to_log({"epochs": 2}) == {}  # logged already in this fit


def test_syncs_of_one_explicit_job_id_share_their_job_state_and_others_do_not(monkeypatch):
    from keras_sync.config import load_config

    monkeypatch.delenv("KERAS_SYNC_JOB_ID", raising=False)
    from keras_sync.training.job_run import JobRun

    def job_state(job_id=None):  # the JobState of a Sync of this config
        return JobRun(load_config({"mlflow": {"job_id": job_id}} if job_id else {}), True).job

    a = JobRun(load_config({"mlflow": {"job_id": "job-7"}}), True)
    assert a.job is job_state("job-7") and a.job is a.job
    assert job_state() is not job_state() and job_state() is not a.job
