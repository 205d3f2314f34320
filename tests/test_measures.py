"""The pure maths of the sync metrics (`keras_sync/measures/`), without TensorFlow."""

from __future__ import annotations

from keras_sync.measures.slow_worker import SlowWorkerWatch


def test_the_slow_worker_line_comes_once_after_the_same_worker_held_the_job_back_for_hold_s() -> (
    None
):
    watch = SlowWorkerWatch(hold_s=60)
    assert watch.update([3.0, 205.0, 2.5], [3.0, 203.0, 2.5], 0.0) is None
    # even again: the clock starts over
    assert watch.update([3.0, 3.0, 2.5], [1.0, 1.0, 1.0], 30.0) is None
    assert watch.update([3.0, 205.0, 2.5], [1.0, 203.0, 1.0], 40.0) is None
    assert watch.update([3.0, 210.0, 2.5], [1.0, 208.0, 1.0], 101.0) == (
        "keras-sync: worker 1 holds the job back: for 61 s it took 210 ms a step to reach the "
        "gradient all-reduce (208 ms between steps, compute 2 ms) against the other workers' median "
        "of 3 ms, and they wait for it. Its times are sync/between_steps_ms/worker_1 and "
        "sync/compute_ms/worker_1 in MLflow."
    )
    assert watch.update([3.0, 210.0, 2.5], [1.0, 208.0, 1.0], 200.0) is None  # said once


def test_window_peaks_keep_the_largest_value_of_unlogged_steps() -> None:
    from keras_sync.measures.reduce import window_peaks

    p = window_peaks(window_peaks(None, [0.5, 0.7], [1.0, 3.0]), [0.4, 9.0], [1.0, 1.0])
    assert (
        p["sync/window_max/loss"],
        p["sync/window_max/loss_spread"],
        p["sync/window_max/grad_norm"],
    ) == (9.0, 8.6, 3.0)


def test_worker_times_leave_out_what_was_not_measured() -> None:
    from keras_sync.measures.slow_worker import worker_times

    # an epoch's first step: no step before it
    assert worker_times([-1, -1], [3000, 4000], 2) == {
        "sync/compute_ms/worker_0": 3.0,
        "sync/compute_ms/worker_1": 4.0,
    }
