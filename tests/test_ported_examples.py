"""keras-io examples ported with keras-sync's three lines train as on one device: 2 replicas and 2 workers.

The cases (tests/_ported_examples.py) are cut from the examples where distributed training went
wrong silently: the text-classification transformer (a position table looked up with `arange`,
a token embedding with repeated ids: sparse gradients under Adam), the GAN of "Customizing what
happens in fit" (latents from a `SeedGenerator`) with Dropout, the same guide's custom
`test_step`, and a seeded dataset that reshuffles each epoch (the timeseries weather and image
examples). One process trains each case on 2 simulated CPU replicas and then on one device
(kind `default`: plain Keras, no strategy); two worker processes train the same cases under
`multi_worker_mirrored`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _ports import free_ports

pytestmark = pytest.mark.slow  # starts TensorFlow processes

SCRIPT = Path(__file__).with_name("_ported_examples.py")
#: float32 rounding over a few dozen steps of small models (one device vs 2 replicas: ~1e-6 measured).
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ported")
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    procs = {}

    def start(name: str, mode: str, extra: dict[str, str]) -> None:
        log = open(tmp / f"{name}.log", "w")
        procs[name] = subprocess.Popen(
            [sys.executable, str(SCRIPT), mode, str(tmp / f"{name}.json")],
            cwd=SCRIPT.parent,
            env={**env, **extra},
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    start("replicas", "replicas", {})
    addrs = [f"127.0.0.1:{p}" for p in free_ports(2)]
    for i in range(2):
        start(
            f"worker{i}",
            "worker",
            {
                "TF_CONFIG": json.dumps(
                    {"cluster": {"worker": addrs}, "task": {"type": "worker", "index": i}}
                )
            },
        )
    cache: dict[str, dict] = {}

    def result(name: str) -> dict:
        if name not in cache:
            proc = procs[name]
            try:
                proc.wait(timeout=900)
            except subprocess.TimeoutExpired:
                proc.kill()
            log = (tmp / f"{name}.log").read_text()
            out = tmp / f"{name}.json"
            assert proc.returncode == 0 and out.exists(), (
                f"{name} exited {proc.returncode}:\n{log[-4000:]}"
            )
            cache[name] = json.loads(out.read_text())
            cache[name]["log"] = log
        return cache[name]

    yield result
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def case(results: dict, name: str) -> dict:
    value = results[name]
    assert "unexpected" not in value and "error" not in value, value.get("tb") or value
    return value


def max_diff(a: list, b: list) -> float:
    assert len(a) == len(b)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


RUNS = [("replicas", "replicas/"), ("worker0", "workers/")]


@pytest.mark.parametrize("run,prefix", RUNS)
def test_adam_on_a_position_table_steps_as_on_one_device(runs, run, prefix):
    """keras-io text classification with a transformer: the position `Embedding` looked up with `arange`.

    Its gradient has each row once per replica; the all-reduce concatenates the replicas' slices.
    Without merging the duplicates Adam moved each row by 0.1 x sqrt(2) on 2 replicas, 0.1 on one device.
    """
    one = case(runs("replicas"), "one_device/position_table")["delta"]
    got = case(runs(run), prefix + "position_table")["delta"]
    assert np.allclose(one, 0.1, atol=1e-6), one
    assert max_diff(got, one) < 1e-6, got


def test_a_token_used_twice_trains_as_its_dense_gradient(runs):
    """keras-io text classification: a token embedding looked up with repeated ids (a sparse gradient with
    duplicate rows) trains with Adam as a one-hot matmul of the same table (a dense gradient)."""
    for prefix in ("one_device/", "replicas/"):
        value = case(runs("replicas"), prefix + "repeated_tokens")
        assert max_diff(value["lookup"], value["one_hot"]) < TOLERANCE, prefix


@pytest.mark.parametrize("run,prefix", RUNS)
def test_transformer_block_with_adam_equals_one_device(runs, run, prefix):
    """keras-io text classification with a transformer (token + position embedding, one block), Adam."""
    one = case(runs("replicas"), "one_device/transformer")
    got = case(runs(run), prefix + "transformer")
    assert max_diff(got["weights"], one["weights"]) < TOLERANCE
    assert np.allclose(got["val_loss"], one["val_loss"], rtol=1e-4), (
        got["val_loss"],
        one["val_loss"],
    )


@pytest.mark.parametrize("run,prefix", RUNS)
def test_gan_latents_and_dropout_masks_differ_between_replicas(runs, run, prefix):
    """ "Customizing what happens in fit", the GAN: latents drawn with the model's `SeedGenerator` in
    `train_step`. Each replica draws its own: the generated global batch holds no duplicate, as on one
    device (before: each latent twice). Dropout masks differ between the replicas too."""
    streams = case(runs(run), prefix + "random_streams")
    one = case(runs("replicas"), "one_device/random_streams")
    assert streams["gan"] and all(
        step["distinct"] == step["generated"] == 8 for step in streams["gan"]
    ), streams
    assert all(step["distinct"] == step["generated"] for step in one["gan"]), one
    assert streams["dropout"] and all(step["halves_equal"] == 0 for step in streams["dropout"]), (
        streams
    )


@pytest.mark.parametrize("run,prefix", RUNS)
def test_custom_test_step_reports_one_devices_loss(runs, run, prefix):
    """ "Customizing what happens in fit": the guide's `test_step` (`compute_loss` into a `Mean` tracker, MAE).
    `sync.evaluate` returns one device's loss (before: half of it on 2 replicas; MAE was right)."""
    one = case(runs("replicas"), "one_device/test_step")
    got = case(runs(run), prefix + "test_step")
    assert got["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert got["mae"] == pytest.approx(one["mae"], rel=1e-5)


@pytest.mark.parametrize("run,prefix", RUNS)
def test_a_seeded_dataset_reshuffled_each_epoch_trains_the_batches_of_one_device(runs, run, prefix):
    """keras-io timeseries weather / image classification: a `.shuffle(buffer, seed=...)` that reshuffles
    each epoch. Keras read the first batch's shapes through an extra iterator under a strategy, which
    started a pass of the shuffle: every epoch trained one device's next epoch's order (weights 0.16 off)."""
    one = case(runs("replicas"), "one_device/reshuffle")
    got = case(runs(run), prefix + "reshuffle")
    assert max_diff(got["weights"], one["weights"]) < 1e-5
