"""Nothing process-wide outlives a fit: after `load()` and `Sync.fit` (also a fit that raised),
`evaluate` and `predict`, Keras's, TensorFlow's and Python's own objects are back.

One TensorFlow process (this file run as a script: 2 logical CPU replicas, kind mirrored, a real
sqlite MLflow store) records what differs from what it captured before `load()`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PACKAGE = HERE.parent / "keras_sync"


def _owners() -> dict[str, object]:
    """The classes and modules whose attributes keras-sync could patch, by name."""
    import keras
    import keras.src.backend.tensorflow.random as tf_random
    import keras.src.losses.loss as keras_loss
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.trainers import epoch_iterator
    from keras.src.trainers import trainer as base_trainer

    return {
        "keras.Model": keras.Model,
        "TensorFlowTrainer": tf_trainer.TensorFlowTrainer,
        "Trainer": base_trainer.Trainer,
        "TFEpochIterator": tf_trainer.TFEpochIterator,
        "EpochIterator": epoch_iterator.EpochIterator,
        "keras.optimizers.Optimizer": keras.optimizers.Optimizer,
        "keras.optimizers.SGD": keras.optimizers.SGD,
        "keras.callbacks.BackupAndRestore": keras.callbacks.BackupAndRestore,
        "tf.GradientTape": tf.GradientTape,
        "tf.distribute.Strategy": tf.distribute.Strategy,
        "tf.distribute.ReplicaContext": tf.distribute.ReplicaContext,
        "keras.src.backend.tensorflow.trainer": tf_trainer,
        "keras.src.losses.loss": keras_loss,
        "keras.src.backend.tensorflow.random": tf_random,
    }


def _snapshot() -> dict[str, object]:
    """Every attribute of `_owners`, the public methods named in the issue, and the process hooks."""
    import signal
    import threading

    import keras
    import tensorflow as tf

    snap: dict[str, object] = {
        f"{name}.{attr}": value
        for name, owner in _owners().items()
        for attr, value in list(vars(owner).items())
    }
    for attr in ("fit", "evaluate", "predict", "compile", "save", "save_weights"):
        snap[f"keras.Model.{attr} (resolved)"] = getattr(keras.Model, attr)
    snap["tf.GradientTape.gradient (resolved)"] = tf.GradientTape.gradient
    snap["tf.nn.compute_average_loss"] = tf.nn.compute_average_loss
    snap["keras.src.backend.tensorflow.trainer.TFEpochIterator (class)"] = _owners()[
        "TFEpochIterator"
    ]
    snap["sys.excepthook"] = sys.excepthook
    snap["threading.excepthook"] = threading.excepthook
    snap["SIGTERM handler"] = signal.getsignal(signal.SIGTERM)
    snap["SIGINT handler"] = signal.getsignal(signal.SIGINT)
    return snap


def _differences(before: dict[str, object]) -> list[str]:
    now = _snapshot()
    changed = [k for k, v in before.items() if now.get(k, before) is not v]
    added = [k for k in now if k not in before and not k.startswith("keras.src.")]
    return sorted(changed + [f"{k} (added)" for k in added])


def _scenario(out: Path, uri: str) -> None:
    """The process the tests read: captures, then load, fit, evaluate, predict, a fit that raises."""
    import numpy as np
    import tensorflow as tf  # noqa: F401  (captured before load(): the objects keras-sync meets)

    before = _snapshot()
    assert sys.excepthook is sys.__excepthook__
    import keras_sync

    result: dict[str, object] = {}
    sync = keras_sync.load(
        {
            "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
            "batch": {"per_replica": 8},
            "fault_tolerance": {"backup_dir": str(out / "backup")},
            "mlflow": {"tracking_uri": uri, "experiment": "restored"},
        }
    )
    import keras

    result["replicas"] = sync.num_replicas
    result["after load"] = _differences(before)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [0.0]], dtype="float32")
    with sync.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(sync.lr_schedule()), loss="mse")

    during: list[list[str]] = []

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if not during:
                during.append(_differences(before))

    sync.fit(model, x, y, epochs=2, verbose=0, validation_data=(x, y), callbacks=[Look()])
    result["during fit"] = during[0]
    result["after fit"] = _differences(before)
    sync.evaluate(model, x, y, verbose=0)
    result["after evaluate"] = _differences(before)
    sync.predict(model, x, verbose=0)
    result["after predict"] = _differences(before)

    class Fails(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("the user's callback failed")

    try:
        sync.fit(model, x, y, epochs=2, verbose=0, callbacks=[Fails()])
    except RuntimeError as e:
        result["raised"] = str(e)
    result["after a fit that raised"] = _differences(before)
    # A model compiled in the scope keeps only an instance-level guard: the class's fit is Keras's.
    result["class fit is Keras's"] = type(model).fit is before["keras.Model.fit (resolved)"]
    sync.close()
    result["after close"] = _differences(before)
    (out / "result.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("restored")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID", "KERAS_SYNC_CONFIG")
    }
    r = subprocess.run(
        [sys.executable, __file__, str(out), f"sqlite:///{out / 'mlflow.db'}"],
        cwd=out,
        env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


STAGES = (
    "after load",
    "after fit",
    "after evaluate",
    "after predict",
    "after a fit that raised",
    "after close",
)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_keras_tensorflow_and_python_objects_are_their_own_again(result, stage):
    assert result["replicas"] == 2
    assert result[stage] == [], stage


@pytest.mark.slow
def test_the_fixes_still_apply_during_fit_and_the_failing_fit_raised(result):
    assert result["raised"] == "the user's callback failed"
    assert any(k.startswith("TensorFlowTrainer._make_function") for k in result["during fit"])
    assert result["class fit is Keras's"] is True


def test_no_audit_hook_anywhere_in_the_package():
    found = [
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("*.py")
        if re.search(r"addaudithook", p.read_text(encoding="utf-8"))
    ]
    assert found == []


if __name__ == "__main__":
    _scenario(Path(sys.argv[1]), sys.argv[2])
