"""The input pipeline (`keras_sync.training.pipeline`): sharding decided by the data, batched datasets reconciled.

Pure rules run here (no TensorFlow). The slow tests train through `sync.fit` on 2 simulated
replicas and on 2 workers (`keras-sync launch`, with `RAY_RAYLET_PID` set as in a Ray worker, the
host signal the old code mistook for sharded data), with the user's own pipeline batched by 64 while
the config asks for a global batch of 32 (learning rate scaled for 32). Each must equal plain Keras on
one device at batch 32 and that rate; training at 64 instead lands measurably elsewhere.
Scripts: tests/_pipeline_train.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_sync.cli.plan import make_plan
from keras_sync.config import load_config
from keras_sync.training.pipeline import batch_layout, shard_choice

HERE = Path(__file__).parent
SCRIPT = HERE / "_pipeline_train.py"
KERAS_SYNC = Path(sys.executable).with_name("keras-sync")
SAME = 1e-5
# generator64: a from_generator pipeline has unknown cardinality. Plain Keras 3.10-3.15 ends such an
# epoch by running one step past its end, which moves optimizer.iterations (17 per 16-batch epoch,
# measured with plain Keras 3.15.1 on the default strategy; keras-team/keras#23179);
# `_keras_compat.apply_end_of_data_fix` stops it, and the step counts below fail without it.
KINDS = ("arrays", "batch64", "batch64_map_prefetch", "generator64")
# Issue 22: a keras.utils.PyDataset (batches of 16; batches of 32 read by 2 threads, which Keras's own reader
# trains twice/never in epoch 0 under a strategy); a pipeline already split per worker (a shard op, or
# AutoShardPolicy.OFF with a known or an unknown length); TFRecord files, 1 (fewer than the workers) and 4;
# an endless Python generator with steps_per_epoch (Keras's own generator reader, under a strategy, trained
# batches 0, 1, 6, 7, 8, 9, 0, 1, 2, 3 in epoch 0: 0.31 off one device on 2 replicas).
MORE_KINDS = (
    "arrays_own_part",
    "python_generator",
    "pydataset16",
    "pydataset32_threads",
    "pydataset32_processes",
    "user_shard",
    "own_off",
    "own_off_unknown_length",
    "tfrecord1",
    "tfrecord4",
)
RAY_TF_CONFIG = json.dumps(
    {"cluster": {"worker": ["10.0.0.1:1", "10.0.0.2:1"]}, "task": {"type": "worker", "index": 0}}
)


# -- the rules, without TensorFlow ---------------------------------------------------------------


@pytest.mark.parametrize("configured", ["auto", "data", "file"])
def test_arrays_are_split_by_example_whatever_the_host(configured):
    assert shard_choice("arrays", configured=configured).policy == "data"


def test_arrays_follow_an_explicit_off():
    assert shard_choice("arrays", configured="off").policy == "off"
    assert "its own part" in shard_choice("arrays", configured="off").reason


@pytest.mark.parametrize("own", ["off", "data", "file"])
def test_a_dataset_keeps_the_policy_of_its_own_options(own):
    choice = shard_choice("dataset", configured="data" if own != "data" else "file", own=own)
    assert choice.policy == own and choice.reason.startswith("set in the dataset's own options")


@pytest.mark.parametrize("configured", ["auto", "data", "file", "off"])
def test_a_dataset_without_its_own_policy_gets_the_configured_one(configured):
    assert shard_choice("dataset", configured=configured, own="auto").policy == configured


def test_batch_layout_spells_out_worker_and_replica_shares():
    assert (
        batch_layout(64, 4, 2)
        == "global batch 64 = 32 per worker x 2 workers = 16 per replica x 4 replicas"
    )
    assert batch_layout(64, 1, 1) == "global batch 64 = 64 per replica x 1 replica"


def test_plan_under_ray_splits_arrays_and_shows_the_per_worker_batch():
    # The environment of a Ray Train worker: the old code turned sharding off here.
    env = {"TF_CONFIG": RAY_TF_CONFIG, "RAY_RAYLET_PID": "1"}
    cfg = load_config(
        {"strategy": {"kind": "auto"}, "batch": {"global": 32}, "mlflow": {"enabled": False}},
        environ=env,
    )
    items = make_plan(cfg, environ=env).to_dict()["items"]
    assert items["input.arrays"]["value"] == "shard data"
    assert items["input.arrays"]["note"] == "arrays are split across workers by example"
    assert items["input.datasets"]["value"] == "own policy, else auto"
    assert "(Ray Data: off)" in items["input.datasets"]["note"]
    assert items["input.batched_datasets"]["value"] == "rebatched to 32"
    assert items["batch.per_worker"] == {
        "value": 16,
        "source": "derived",
        "note": "global batch 32 = 16 per worker x 2 workers = 16 per replica x 2 replicas",
    }


def test_plan_command_prints_the_input_rules(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG")}
    r = subprocess.run(
        [str(KERAS_SYNC), "plan", "--global-batch", "48"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "input.arrays" in r.stdout and "shard data" in r.stdout
    assert "rebatched to 48" in r.stdout


# -- real training -------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", **extra)
    return env


def _config(kind: str) -> str:
    strategy = (
        {"kind": "mirrored", "simulated_cpu_replicas": 2}
        if kind == "mirrored"
        else {"kind": "multi_worker_mirrored", "connect_timeout_s": 120}
    )
    # per-replica 16 on 2 replicas: global 32, learning rate 0.05 x 32/16 = 0.1
    return json.dumps(
        {
            "strategy": strategy,
            "batch": {"per_replica": 16},
            "learning_rate": {"base": 0.05},
            "mlflow": {"enabled": False},
        }
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    procs = {
        "reference": subprocess.Popen(
            [sys.executable, str(SCRIPT), "reference", str(out)],
            env=_env(),
            cwd=out,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        "replicas": subprocess.Popen(
            [sys.executable, str(SCRIPT), "replicas", str(out), _config("mirrored")],
            env=_env(),
            cwd=out,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        "workers": subprocess.Popen(
            [
                str(KERAS_SYNC),
                "launch",
                "--workers",
                "2",
                str(SCRIPT),
                "workers",
                str(out),
                _config("mwms"),
            ],
            env=_env(RAY_RAYLET_PID="1"),
            cwd=out,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
    }
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name} failed:\n{log[-4000:]}"
    read = lambda name: json.loads((out / f"{name}.json").read_text())  # noqa: E731
    return {
        "reference": read("reference"),
        "replicas": read("replicas-w0"),
        "w0": read("workers-w0"),
        "w1": read("workers-w1"),
    }


def _diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.mark.slow
def test_the_comparison_can_tell_batch_64_from_batch_32(runs):
    ref = runs["reference"]
    assert ref["steps"] == 32  # 512 examples / 32 x 2 epochs
    assert _diff(ref["weights_batch64"], ref["weights"]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS + MORE_KINDS)
def test_user_batched_pipeline_trains_on_the_global_batch_on_2_replicas(runs, kind):
    r = runs["replicas"]
    assert (r["replicas"], r["workers"], r["global_batch"], r["learning_rate"]) == (
        2,
        1,
        32,
        pytest.approx(0.1),
    )
    assert _diff(r["weights"][kind], runs["reference"]["weights"]) <= SAME


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS + MORE_KINDS)
def test_user_batched_pipeline_trains_on_the_global_batch_on_2_workers(runs, kind):
    for w in ("w0", "w1"):
        r = runs[w]
        assert (r["replicas"], r["workers"], r["global_batch"]) == (2, 2, 32)
        assert _diff(r["weights"][kind], runs["reference"]["weights"]) <= SAME, (w, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batch64", "batch64_map_prefetch", "generator64", *MORE_KINDS])
def test_every_pipeline_takes_one_optimizer_step_per_batch(runs, kind):
    # generator64 included: its length is unknown, and Keras's extra step at the end of each
    # epoch would make this 34 (the learning-rate schedule, warmup and backups count these).
    assert (
        runs["replicas"]["steps"][kind]
        == runs["w0"]["steps"][kind]
        == runs["w1"]["steps"][kind]
        == 32
    )


@pytest.mark.slow
def test_unknown_batch_warns_once_on_the_chief(runs):
    for r in (runs["replicas"], runs["w0"]):
        (warning,) = r["warnings"]["generator64"]
        assert warning.startswith(
            "keras-sync: cannot tell the batch size of the dataset given to sync.fit (no static "
            "batch dimension and no batch op, e.g. from_generator or Ray Data's to_tf); it was "
            "rebatched to the configured global batch 32. Fix: "
        )
        assert "pass it through sync.distribute(...)" in warning
        assert r["warnings"]["batch64"] == [] and r["warnings"]["arrays"] == []
    assert runs["w1"]["warnings"]["generator64"] == []


@pytest.mark.slow
def test_data_of_unknown_length_ends_its_epochs_without_keras_false_alarm(runs):
    # Keras warns "Your input ran out of data ... use .repeat()" at every such epoch end (seen in
    # a user trial); without steps_per_epoch that is how the epoch ends, so sync.fit hides it.
    for r in (runs["replicas"], runs["w0"], runs["w1"]):
        assert r["ran_out"]["generator64"] == []


@pytest.mark.slow
def test_batch_size_is_read_from_shape_or_batch_op(runs):
    found = runs["replicas"]["probes"]["found"]
    assert found["static"] == [64, "static shape"]
    assert (
        found["batch_op"]
        == found["map_after_batch"]
        == found["parallel_batch"]
        == [64, "its batch op"]
    )
    assert found["padded"] == [16, "its batch op"]
    assert found["generator"][0] is None


@pytest.mark.slow
def test_own_policy_is_kept_and_arrays_are_sharded_by_data(runs):
    p = runs["replicas"]["probes"]
    assert p["own_off_kept"] == p["distribute_off_kept"] == "off"
    assert p["arrays_policy"] == "data"
    assert p["rebatched_cardinality"] == 16  # 512 / 32: the size stays known


@pytest.mark.slow
def test_unbatched_dataset_given_to_fit_is_refused_with_the_fix(runs):
    msg = runs["replicas"]["probes"]["unbatched_error"]
    assert msg.startswith(
        "sync.fit received a tf.data.Dataset of single examples, not batches (element_spec="
    )
    assert "Fix: pass it through sync.distribute(dataset)" in msg


@pytest.mark.slow
def test_python_generators_it_cannot_read_exactly_are_refused_with_the_fix(runs):
    refused = runs["replicas"]["probes"]["refused_generators"]
    assert refused["generator_epochs_without_steps"].startswith(
        "sync.fit received a Python generator with epochs=2 and no steps_per_epoch: "
    )
    assert (
        "Fix: pass steps_per_epoch=<batches per epoch>" in refused["generator_epochs_without_steps"]
    )
    assert refused["validation_generator"].startswith(
        "sync.fit received validation_data as a Python generator: "
    )
    assert (
        "Fix: give validation_data as arrays, a keras.utils.PyDataset or a tf.data.Dataset."
        in refused["validation_generator"]
    )


@pytest.mark.slow
def test_a_python_generator_is_read_in_order_each_batch_once(runs):
    for r in (runs["replicas"], runs["w0"], runs["w1"]):
        assert r["facts"]["python_generator"]["source"] == "Python generator"


@pytest.mark.slow
def test_py_dataset_is_read_by_index_and_rebatched(runs):
    for r in (runs["replicas"], runs["w0"], runs["w1"]):
        assert r["facts"]["pydataset16"]["source"] == "keras.utils.PyDataset"
        assert r["facts"]["pydataset16"]["examples_per_epoch"] == 512
        assert r["facts"]["pydataset16"]["steps_per_epoch"] == 16
    # Two workers, a pipeline that reads no files: split by example.
    assert runs["w0"]["facts"]["pydataset16"]["shard_policy"] == "data"


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind", ["arrays_own_part", "user_shard", "own_off", "own_off_unknown_length"]
)
def test_a_workers_own_part_is_neither_sharded_again_nor_cut_short(runs, kind):
    for w in ("w0", "w1"):
        facts = runs[w]["facts"][kind]
        assert facts["own_part"] is True and facts["shard_policy"] == "off"
        if kind != "own_off_unknown_length":
            assert (facts["worker_examples_per_epoch"], facts["steps_per_epoch"]) == (256, 16)
            assert facts["examples_per_epoch"] == 512  # the parts' lengths, summed over the workers
    # One worker: nothing to split, the dataset is the whole data.
    assert runs["replicas"]["facts"][kind]["own_part"] is False


@pytest.mark.slow
def test_too_few_files_for_the_workers_are_split_by_example_before_training(runs):
    assert (
        runs["w0"]["facts"]["tfrecord1"]["shard_policy"]
        == runs["w1"]["facts"]["tfrecord1"]["shard_policy"]
        == "data"
    )
    assert runs["w0"]["facts"]["tfrecord4"]["shard_policy"] == "file"
    assert runs["w1"]["facts"]["tfrecord4"]["shard_policy"] == "file"


@pytest.mark.slow
def test_py_dataset_without_a_length_is_refused_with_the_fix(runs):
    assert runs["replicas"]["probes"]["endless_py_dataset_error"] == (
        "sync.fit received a keras.utils.PyDataset without a length (Endless has neither __len__ nor num_batches); "
        "keras-sync reads a PyDataset by index, each batch once per epoch. Fix: give it __len__, or a num_batches "
        "property (None for an endless one, with steps_per_epoch in fit)."
    )


@pytest.mark.slow
def test_own_parts_of_different_lengths_end_their_epochs_together(runs):
    # ds.shard(2, i) of 481 examples: 241 and 240, 16 and 15 per-replica batches. With those lengths as
    # Keras's steps worker 0 would wait alone in step 16's all-reduce; unknown, both end when all parts have.
    for w in ("w0", "w1"):
        assert runs[w]["steps"]["user_shard_uneven"] == 32
        facts = runs[w]["facts"]["user_shard_uneven"]
        assert (facts["examples_per_epoch"], facts["steps_per_epoch"]) == (481, None)
    assert runs["w0"]["facts"]["user_shard_uneven"]["worker_examples_per_epoch"] == 241
    assert runs["w1"]["facts"]["user_shard_uneven"]["worker_examples_per_epoch"] == 240
    assert runs["w0"]["weights"]["user_shard_uneven"] == runs["w1"]["weights"]["user_shard_uneven"]
