"""The training step on N replicas equals one device: custom train_step gradients and the `runtime` section.

Real strategies: tests/_runtime_scenarios.py runs on one device, on 2 simulated CPU replicas
(MirroredStrategy) and as 2 workers through `keras-sync launch` (MultiWorkerMirroredStrategy), all
three started at once; the tests compare what each recorded.
"""

from __future__ import annotations

import dataclasses
import doctest
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _mwr import kill_and_resume, max_diff

from keras_sync.config import RuntimeConfig, load_config
from keras_sync.errors import ConfigError
from keras_sync.training import train_step_trace as _train_step_trace

HERE = Path(__file__).parent
KERAS_SYNC = str(Path(sys.executable).with_name("keras-sync"))
TOLERANCE = 1e-5


def test_train_step_trace_doctests():
    assert doctest.testmod(_train_step_trace).failed == 0


def test_averaging_message_names_the_model_the_factor_and_the_switch():
    class MyModel:
        pass

    applies = [{"optimizer": "optimizer", "scaled_by": None, "factor": 0.25}]
    [msg] = _train_step_trace.trace_lines(MyModel(), 4, applies, "auto")
    assert "\n" not in msg
    assert msg.startswith(
        "keras-sync: MyModel.train_step does not divide its loss by the replica count"
    )
    assert "divides them by 4 at the optimizer" in msg
    assert msg.endswith("set runtime.train_step_gradients: sum.")


def test_train_step_gradients_bad_value_names_file_line_and_close_match(tmp_path):
    path = tmp_path / "ks.yaml"
    path.write_text("batch: {per_replica: 8}\nruntime:\n  train_step_gradients: averge\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(exc.value) == (
        f"{path}:3: runtime.train_step_gradients: received 'averge', expected one of auto, "
        "average, sum; did you mean 'average'?"
    )


def test_runtime_defaults_change_nothing():
    rt = load_config({}).runtime
    assert (
        rt.mixed_precision,
        rt.jit_compile,
        rt.steps_per_execution,
        rt.gradient_accumulation_steps,
        rt.sync_batch_norm,
        rt.train_step_gradients,
    ) == ("none", "auto", 1, 1, False, "auto")


@pytest.mark.parametrize(
    "text,line,message",
    [
        (
            "runtime:\n  steps_per_execution: 0\n",
            2,
            "runtime.steps_per_execution: received 0, expected an integer >= 1",
        ),
        (
            "runtime:\n  mixed_precision: fp16\n",
            2,
            "runtime.mixed_precision: received 'fp16', expected one of none, mixed_float16, mixed_bfloat16; "
            "did you mean 'mixed_float16'?",
        ),
        (
            "runtime:\n  mixed_precision: bf16\n",
            2,
            "runtime.mixed_precision: received 'bf16', expected one of none, mixed_float16, mixed_bfloat16; "
            "did you mean 'mixed_bfloat16'?",
        ),
        (
            "runtime:\n  gradient_accumulation_steps: -2\n",
            2,
            "runtime.gradient_accumulation_steps: received -2, expected an integer >= 1",
        ),
        (
            "runtime:\n  jit_compile: xla\n",
            2,
            "runtime.jit_compile: received 'xla', expected auto, true or false",
        ),
        (
            "runtime:\n  sync_batch_norm: yes please\n",
            2,
            "runtime.sync_batch_norm: received 'yes please', expected true or false",
        ),
        (
            "runtime: {gradient_accumulation_steps: 4}\nfault_tolerance:\n  save_freq: 10\n",
            3,
            "fault_tolerance.save_freq: received save_freq=10 with runtime.gradient_accumulation_steps=4; back up at "
            "optimizer updates: use a multiple of 4 (e.g. 8) or 'epoch'",
        ),
    ],
)
def test_bad_runtime_values_name_file_line_key_and_fix(tmp_path, text, line, message):
    path = tmp_path / "ks.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(exc.value) == f"{path}:{line}: {message}"


def test_validate_cli_prints_runtime_errors_with_file_and_line(tmp_path):
    path = tmp_path / "ks.yaml"
    path.write_text(
        "batch: {per_replica: 8}\nruntime:\n  steps_per_execution: 0\n  mixed_precision: fp16\n"
    )
    proc = subprocess.run(
        [KERAS_SYNC, "validate", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert f"{path}:3: runtime.steps_per_execution: received 0" in proc.stderr + proc.stdout
    assert f"{path}:4: runtime.mixed_precision: received 'fp16'" in proc.stderr + proc.stdout


def test_template_shows_the_runtime_section_commented():
    from keras_sync.config.reference import config_template

    text = config_template()
    section = text[text.index("# runtime:") :]
    keys = [
        ln.split(":")[0].strip("# ")
        for ln in section.splitlines()
        if ln.startswith("#   ") and not ln.startswith("#   #")
    ]
    # Every runtime key, in declaration order: a key added by CONTRIBUTING's config-key recipe needs no edit here.
    assert keys == [f.name for f in dataclasses.fields(RuntimeConfig)]
    assert keys[:3] == [
        "mixed_precision",
        "jit_compile",
        "steps_per_execution",
    ]  # the scan still reads the section
    assert all(ln.startswith("#") for ln in section.splitlines() if ln)
    # Uncommented, it is the defaults.
    import yaml

    data = yaml.safe_load("\n".join(ln[2:] for ln in section.splitlines() if ln))
    assert load_config(data).runtime == load_config({}).runtime


def test_plan_prints_the_effective_batch_and_scales_the_rate_from_it(tmp_path):
    path = tmp_path / "ks.yaml"
    path.write_text(
        "batch: {per_replica: 8}\nlearning_rate: {base: 0.1, base_batch_size: 8}\n"
        "runtime: {gradient_accumulation_steps: 4}\nmlflow: {enabled: false}\n"
    )
    proc = subprocess.run(
        [KERAS_SYNC, "plan", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TF_CONFIG": ""},
    )
    assert proc.returncode == 0, proc.stderr
    items = json.loads(proc.stdout)["items"]
    assert (
        items["batch.effective"]["value"] == 32 and items["batch.effective"]["source"] == "derived"
    )
    assert items["runtime.gradient_accumulation_steps"]["source"] == "file"
    assert items["learning_rate.scaled"]["value"] == pytest.approx(0.4)  # 0.1 x 32 / 8


# ---- real training runs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runtime")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for k in ("TF_CONFIG", "KERAS_SYNC_CONFIG", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    script = str(HERE / "_runtime_scenarios.py")
    tracking = {layout: f"sqlite:///{out / f'{layout}-mlflow.db'}" for layout in ("two", "workers")}
    cmds = {
        "one": [sys.executable, script, "replicas", "1", str(out / "one.json")],
        "two": [sys.executable, script, "replicas", "2", tracking["two"], str(out / "two.json")],
        # keras-sync launch: 2 workers, ONE MultiWorkerMirroredStrategy each, every scenario trained under it.
        "workers": [
            KERAS_SYNC,
            "launch",
            "--workers",
            "2",
            script,
            "workers",
            tracking["workers"],
            str(out / "workers.json"),
        ],
        # 2 workers x 2 simulated replicas each: 4 replicas over 2 processes (spe and accumulation only).
        "workers_x2": [
            KERAS_SYNC,
            "launch",
            "--workers",
            "2",
            script,
            "workers_x2",
            str(out / "workers_x2.json"),
        ],
    }
    procs = {
        name: subprocess.Popen(
            cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, cmd in cmds.items()
    }
    results, logs = {}, {}
    for name, proc in procs.items():
        logs[name], _ = proc.communicate(timeout=1500)
        assert proc.returncode == 0, f"{name} failed:\n{logs[name][-5000:]}"
        results[name] = json.loads((out / f"{name}.json").read_text())
    results["logs"] = logs
    results["tracking"] = tracking
    return results


def _ok(result):
    assert not (isinstance(result, dict) and "unexpected" in result), result.get("tb", result)
    return result


def _diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


CUSTOM = ("guide", "compute_loss", "divided", "average_loss", "sum_loss", "two_optimizers")


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_custom_train_steps_on_two_replicas_and_two_workers_equal_one_device(runs):
    one = _ok(runs["one"]["custom_steps"])
    assert runs["two"]["num_replicas"] == 2
    assert runs["workers"]["num_replicas"] == 2 and runs["workers"]["num_workers"] == 2
    for layout in ("two", "workers"):
        res = _ok(runs[layout]["custom_steps"])
        for name in ("keras", *CUSTOM):
            assert _diff(res[name]["weights"], one[name]["weights"]) <= TOLERANCE, (layout, name)
    # ... and the model trained: a step of the guide's model with Keras's sum is 2x, and ends elsewhere.
    two = runs["two"]["custom_steps"]
    assert _diff(two["guide_sum"]["weights"], one["guide"]["weights"]) > 100 * TOLERANCE
    assert (
        _diff(one["guide"]["weights"], runs["one"]["custom_steps"]["guide_sum"]["weights"]) == 0.0
    )


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_an_add_loss_sum_over_the_batch_is_said_in_one_line_and_a_mean_equals_one_device(runs):
    one = _ok(runs["one"]["custom_steps"])
    for layout in ("two", "workers"):
        res = _ok(runs[layout]["custom_steps"])
        # add_loss(rate * ops.sum(x)): each replica's add_loss terms are divided by the replica count (right for a
        # mean or a weight penalty, not for a sum over the batch): measured 0.109 off one device.
        assert (
            _diff(res["add_loss_sum"]["weights"], one["add_loss_sum"]["weights"]) > 100 * TOLERANCE
        ), layout
        # The same term as a mean times the global batch (what the line advises) equals one device's sum and mean.
        assert (
            _diff(res["add_loss_mean"]["weights"], one["add_loss_mean"]["weights"]) <= TOLERANCE
        ), layout
        assert (
            _diff(res["add_loss_mean"]["weights"], one["add_loss_sum"]["weights"]) <= TOLERANCE
        ), layout
        print(
            layout,
            "add_loss sum vs one device",
            _diff(res["add_loss_sum"]["weights"], one["add_loss_sum"]["weights"]),
            "mean",
            _diff(res["add_loss_mean"]["weights"], one["add_loss_mean"]["weights"]),
        )
    # One line on the chief for the sum (custom_steps' fit; add_loss_checks' MLflow fit on "two"), none for the
    # mean, none on one device (nothing is divided there).
    for layout, fits in (("two", 2), ("workers", 1)):
        lines = [ln for ln in runs["logs"][layout].splitlines() if "check add_loss failed" in ln]
        assert len(lines) == fits, (layout, lines)
        assert (
            "keras-sync: check add_loss failed: add_loss term 1 of 1 (in the order of model.losses) sums over "
            "the batch"
        ) in lines[0], lines[0]
        assert (
            "counts 1/2 of one device's" in lines[0]
            and "rate * 64 * ops.mean(ops.sum(x, axis=-1))" in lines[0]
        )
        assert lines[0].endswith("(checks.on_violation: warn)")
    assert (
        "[w0]" in [ln for ln in runs["logs"]["workers"].splitlines() if "check add_loss" in ln][0]
    )
    assert "check add_loss" not in runs["logs"]["one"]


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_the_add_loss_check_tags_the_mlflow_run_and_stops_the_fit_under_on_violation_error(runs):
    from mlflow import MlflowClient

    res = _ok(runs["two"]["add_loss_checks"])
    tags = MlflowClient(runs["tracking"]["two"]).get_run(res["run_id"]).data.tags
    assert tags["keras_sync.check.add_loss"].startswith(
        "add_loss term 1 of 1 (in the order of model.losses) sums over"
    )
    assert res["error"].startswith("CheckFailed: check add_loss failed: add_loss term 1 of 1")
    assert (
        res["error"].endswith("(checks.on_violation: error)") and res["iterations"] == 0
    )  # before the first step


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_what_divided_the_loss_is_detected_and_only_an_undivided_loss_is_averaged(runs):
    trace = {
        name: v["trace"] for name, v in _ok(runs["two"]["custom_steps"]).items() if "trace" in v
    }
    assert trace["guide"] == {"scaled_by": None, "factor": 0.5}
    assert trace["compute_loss"] == {"scaled_by": "a Keras loss", "factor": 1.0}
    assert trace["divided"] == {"scaled_by": "num_replicas_in_sync", "factor": 1.0}
    assert trace["average_loss"] == {"scaled_by": "tf.nn.compute_average_loss", "factor": 1.0}
    # issue 23: a loss object with reduction="sum" needs no division; a GAN's two optimizers are decided apart.
    assert trace["sum_loss"] == {"scaled_by": "a Keras loss with reduction='sum'", "factor": 1.0}
    assert trace["two_optimizers"]["per_optimizer"] == {
        "d_optimizer": ["a Keras loss", 1.0],
        "g_optimizer": [None, 0.5],
    }
    # One line, on the chief only, before training, for the model keras-sync averages.
    # both also trace a ScaleLossStep (mixed_float16); "two" a GuideStep for its dtypes, twice (with and
    # without the slow-worker timestamps)
    for layout, models in (("two", 4), ("workers", 2)):
        lines = [ln for ln in runs["logs"][layout].splitlines() if "does not divide its loss" in ln]
        assert len(lines) == models + 1, (layout, lines)  # + the GAN's g_optimizer
        assert (
            "GuideStep.train_step" in lines[0] and "runtime.train_step_gradients: sum" in lines[0]
        )
        assert [ln for ln in lines if "TwoOptimizers" in ln][0].count(
            "does not divide its loss for g_optimizer by"
        ) == 1
        # mixed_float16: the loss is divided where keras-sync divides it, in scale_loss (the line says so).
        assert (
            "keras-sync divides the loss by 2 in optimizer.scale_loss (before the float16 backward pass)"
            in [ln for ln in lines if "ScaleLossStep" in ln][0]
        )
        # issue 23: a loss divided by Keras is one replica's share in the user's own tracker: said once per model.
        shares = [ln for ln in runs["logs"][layout].splitlines() if "is one replica's share" in ln]
        assert len(shares) == 3 and "1/2 of the one-device value" in shares[0], (layout, shares)
    assert (
        "[w0]" in [ln for ln in runs["logs"]["workers"].splitlines() if "does not divide" in ln][0]
    )


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_custom_train_steps_get_the_same_per_replica_loss_and_grad_norm_as_keras_step(runs):
    for layout in ("two", "workers"):
        res = _ok(runs[layout]["custom_steps"])
        keras_step = res["keras"]
        assert keras_step["steps"] == 16 and len(keras_step["loss"]) == 16
        # Replicas see different halves of each batch: their values differ.
        assert all(abs(a - b) > 1e-6 for a, b in keras_step["loss"])
        for name in CUSTOM[:4]:  # the same model and loss as Keras's step
            for key in ("loss", "grad_norm"):
                assert _diff(res[name][key], keras_step[key]) <= 1e-4 * max(
                    1.0, _diff(keras_step[key], 0)
                ), (layout, name, key)


# ---- the runtime section on real strategies (issue 13) --------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_steps_per_execution_4_equals_1_on_two_replicas_and_on_two_workers(runs):
    one_spe_1 = runs["one"]["custom_steps"]["keras"]["weights"]  # the same model and data at 1
    for layout in ("one", "two", "workers"):
        res = _ok(runs[layout]["spe"])
        assert "error" not in res, (layout, res)
        assert res["spe"] == 4 and res["iterations"] == 16, layout
        assert (
            _diff(res["weights"], runs[layout]["custom_steps"]["keras"]["weights"]) <= TOLERANCE
        ), layout
        assert _diff(res["weights"], one_spe_1) <= TOLERANCE, layout
    # Multi-worker (keras-team/keras#19246): 2 workers through keras-sync launch, one replica each,
    # and 2 workers x 2 simulated replicas (4 replicas in sync, 16 examples each).
    assert runs["workers"]["num_workers"] == 2 and runs["workers"]["num_replicas"] == 2
    x2 = _ok(runs["workers_x2"]["spe"])
    assert runs["workers_x2"]["num_workers"] == 2 and runs["workers_x2"]["num_replicas"] == 4
    assert "error" not in x2 and x2["spe"] == 4 and x2["iterations"] == 16, x2
    assert _diff(x2["weights"], one_spe_1) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(1600)
@pytest.mark.parametrize("layout", ["two", "workers"])
def test_steps_per_execution_4_logs_a_point_at_every_optimizer_step(runs, layout):
    from mlflow import MlflowClient

    client = MlflowClient(runs["tracking"][layout])
    run_id = runs[layout]["spe"]["run_id"]
    for key in (
        "sync/loss/replica_0",
        "sync/grad_norm/replica_1",
        "sync/learning_rate",
        "sync/step_time_ms",
    ):
        steps = sorted(m.step for m in client.get_metric_history(run_id, key))
        assert steps == list(range(1, 17)), key
    # The replicas' values differ from step to step (each step its own row, not the execution's last).
    losses = [
        m.value
        for m in sorted(
            client.get_metric_history(run_id, "sync/loss/replica_0"), key=lambda m: m.step
        )
    ]
    assert len(set(losses)) == 16
    # Keras's own logs come once per execution of 4 steps.
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [4, 8, 12, 16]


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_gradient_accumulation_2_x_8_equals_16_with_sgd_and_adam(runs):
    for layout in ("one", "two", "workers", "workers_x2"):
        res = _ok(runs[layout]["accumulation"])
        for opt in ("sgd", "adam"):
            acc, ref = res[f"{opt}_acc"], res[f"{opt}_ref"]
            assert "error" not in acc and "error" not in ref, (layout, opt, acc, ref)
            assert acc["effective"] == ref["effective"] and acc["lr"] == ref["lr"], (layout, opt)
            assert acc["iterations"] == ref["iterations"], (
                layout,
                opt,
            )  # updates, not micro-batches
            assert _diff(acc["weights"], ref["weights"]) <= TOLERANCE, (layout, opt)
    # 2 workers of one replica each train like 2 simulated replicas (same global batches), and the
    # learning rate was scaled from the effective batch (2 replicas x 16 = 32: 0.01 x 32 / 16).
    two, workers = runs["two"]["accumulation"], runs["workers"]["accumulation"]
    for key in ("sgd_acc", "sgd_ref", "adam_acc", "adam_ref"):
        assert workers[key]["effective"] == 32 and workers[key]["lr"] == pytest.approx(0.02), key
        assert _diff(workers[key]["weights"], two[key]["weights"]) <= TOLERANCE, key


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_gradient_clipping_on_two_replicas_and_two_workers_clips_what_one_device_clips(runs):
    """Keras clips each replica's share before it all-reduces (plain MirroredStrategy too: clipnorm 0.69,
    global_clipnorm 0.72, clipvalue 0.47 off one device, measured); keras-sync clips the sum."""
    one = _ok(runs["one"]["optimizer_options"])
    for clip in ("clipnorm", "global_clipnorm", "clipvalue", "embedding_clipnorm"):
        unclipped = "embedding_none" if clip.startswith("embedding") else "none"
        assert _diff(one[clip], one[unclipped]) > 1e-3, (
            clip
        )  # the clipping is active: the comparison can tell
        for layout in ("two", "workers"):
            assert _diff(_ok(runs[layout]["optimizer_options"])[clip], one[clip]) <= TOLERANCE, (
                layout,
                clip,
            )


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_optimizer_options_that_crash_under_a_strategy_are_refused_with_the_fix(runs):
    for layout in ("two", "workers"):
        res = _ok(runs[layout]["optimizer_options"])
        assert res["gradient_accumulation_steps"].startswith(
            "sync.fit: the model's optimizer SGD(gradient_accumulation_steps=2) fails under a "
        )
        assert res["gradient_accumulation_steps"].endswith(
            "Fix: remove it from the optimizer and set runtime.gradient_accumulation_steps: 2 in the keras-sync config "
            "(same update, on any replica count)."
        )
        assert res["use_ema"].startswith(
            "sync.fit: the model's optimizer SGD(use_ema=True) fails under a "
        )
        assert "Fix: remove use_ema" in res["use_ema"]


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_sync_batch_norm_on_two_replicas_and_two_workers_equals_one_device(runs):
    one = _ok(runs["one"]["sync_bn"])["off"]["weights"]
    for layout in ("two", "workers"):
        res = _ok(runs[layout]["sync_bn"])
        assert res["on"]["synchronized"] is True
        assert _diff(res["on"]["weights"], one) <= TOLERANCE, layout
    # Without it the replicas' statistics differ from the global batch's, and a line says so.
    assert _diff(runs["two"]["sync_bn"]["off"]["weights"], one) > 100 * TOLERANCE
    lines = [
        ln
        for ln in runs["logs"]["two"].splitlines()
        if "BatchNormalization layer(s) with per-replica" in ln
    ]
    assert (
        len(lines) == 1
        and "runtime.sync_batch_norm: true" in lines[0]
        and "the 32 examples" in lines[0]
    )


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_mixed_precision_on_two_replicas(runs):
    res = _ok(runs["two"]["mixed"])
    f32 = res["none"]
    for policy, compute in (("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")):
        r = res[policy]
        assert (r["policy"], r["compute"], r["variable"]) == (policy, compute, "float32")
        assert all(np.isfinite(r["loss"])) and r["loss"][-1] < r["loss"][0]
        ratio = np.asarray(r["grad_norm"][:8]) / np.asarray(f32["grad_norm"][:8])
        assert np.all((ratio > 0.5) & (ratio < 2.0)), (policy, ratio)
    assert res["mixed_float16"]["optimizer"] == "LossScaleOptimizer"
    assert all(s >= 1.0 for s in res["mixed_float16"]["loss_scale"])
    assert res["mixed_bfloat16"]["optimizer"] == "SGD" and np.all(
        np.isnan(res["mixed_bfloat16"]["loss_scale"])
    )


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_mixed_float16_on_two_replicas_and_two_workers_skips_the_steps_one_device_skips(runs):
    one = _ok(runs["one"]["mixed_custom"])
    for layout in ("two", "workers"):
        _mixed_float16_equals_one_device(one, dict(_ok(runs[layout]["mixed_custom"])), layout)


def _mixed_float16_equals_one_device(one, two, layout):
    # Keras's step, a custom step that scales its loss, and data whose first batch overflows on the second replica
    # only: the same updates applied and the same final loss scale as one device, finite weights. Before, Keras's
    # LossScaleOptimizer judged the first replica's local gradients: 32 of 32 updates vs 31 (a float16 sum that
    # overflows on one device is finite per replica), 0.375 off; the second replica's overflow: 1 update, inf weights;
    # 2 workers: Keras's step hung (no step in 10 minutes; the same script in float32 ends in under one).
    assert (
        one["keras"]["updates"] == 31 and one["second_replica_overflows"]["updates"] == 28
    )  # steps skipped
    for name in ("keras", "scale_loss", "second_replica_overflows"):
        assert (two[name]["updates"], two[name]["scale"]) == (
            one[name]["updates"],
            one[name]["scale"],
        ), (layout, name)
        assert all(np.isfinite(two[name]["weights"])), (layout, name)
    # What remains is float16 rounding: one device's float16 gradient rounds the batch's sum, each replica its half.
    # The same split on one device (HalvesStep) gives the size of that alone.
    floor = _diff(one["halves"]["weights"], one["keras"]["weights"])
    assert (one["halves"]["updates"], one["halves"]["scale"]) == (
        one["keras"]["updates"],
        one["keras"]["scale"],
    )
    # Without the pass-through of the sums (a Keras that moved it) the result is the same.
    reduced_twice = two.pop("keras_reduced_twice")
    assert (reduced_twice["updates"], reduced_twice["scale"]) == (
        two["keras"]["updates"],
        two["keras"]["scale"],
    )
    assert _diff(reduced_twice["weights"], two["keras"]["weights"]) <= 1e-7
    diffs = {name: _diff(two[name]["weights"], one[name]["weights"]) for name in two}
    print(
        "mixed_float16,",
        layout,
        "vs one device:",
        diffs,
        "float16 split alone on one device:",
        floor,
        "updates",
        {k: v["updates"] for k, v in two.items()},
        "scale",
        {k: v["scale"] for k, v in two.items()},
    )
    assert 0 < floor < 5e-3
    for name, diff in diffs.items():
        assert diff < 3 * floor, (layout, name, diff, floor)


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_jit_compile_true_equals_false_on_one_device_and_is_refused_for_replicas_on_cpus(runs):
    res = _ok(runs["one"]["jit"])
    assert res["True"]["jit"] is True and res["False"]["jit"] is False
    assert _diff(res["True"]["weights"], res["False"]["weights"]) <= TOLERANCE
    # Replicas on CPUs: XLA has no CPU collectives and cannot span logical devices; refused before training.
    for layout in ("two", "workers"):
        res = _ok(runs[layout]["jit"])
        assert res["True"]["error"].startswith(
            "UsageError: Invalid value for runtime.jit_compile. Received: true with 2 "
            "replicas on CPU devices"
        ), layout
        assert res["False"]["jit"] is False


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_instrumented_train_step_has_no_float64(runs):
    # As on a TPU (no float64 there): the step without the slow-worker timestamps, which are float64.
    dtypes = _ok(runs["two"]["dtypes_untimed"])
    assert "float32" in dtypes and "int64" in dtypes  # the step and the probe's ring
    assert "float64" not in dtypes, dtypes
    assert "float64" in _ok(runs["two"]["dtypes"])  # the timestamps: the comparison can tell


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_steps_per_execution_4_resumes_exactly_after_sigkill(tmp_path):
    """2 simulated replicas, steps_per_execution 4 from the YAML, a backup every 4 batches, SIGKILL at step 20."""
    cfg = {
        "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
        "batch": {"global": 32},
        "mlflow": {"enabled": False},
        "learning_rate": {"base": 0.01},
        "runtime": {"steps_per_execution": 4},
        "fault_tolerance": {"save_freq": 4},
    }
    a, b, second = kill_and_resume(tmp_path, cfg, kill_at=20, timeout=400)
    assert a["num_replicas"] == 2
    assert b["start"] == {"iterations": 20, "epoch": 2}  # step 20 = epoch 2 after 4 of 8 batches
    assert (
        second.stdout.splitlines()[0] == "step 24 epoch 2 batch 7"
    )  # one execution of 4 steps later
    assert b["iterations"] == a["iterations"] == 32
    assert max_diff(a["weights"], b["weights"]) <= 1e-6
