"""A plain training script that saves the way users do, for tests/test_saving.py.

Usage: python _save_train.py SAVE_DIR RESULT_DIR
Runs as one worker of a multi-worker job (TF_CONFIG set by the test) or alone. Trains with
`ModelCheckpoint(save_best_only=True)`, Keras' `BackupAndRestore`, `TensorBoard` and `CSVLogger`
passed to `sync.fit` (with validation data, so TensorBoard writes `validation` too), then
calls `model.save`, `model.save_weights` and `sync.save`, all into SAVE_DIR, on every worker.
An audit hook records every Python-level open for writing under SAVE_DIR. Writes
RESULT_DIR/w<task>.json: chief or not, the epoch losses, the model's predictions on a fixed
probe after each epoch and at the end, and the recorded opens.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAMPLES, FEATURES, EPOCHS = 256, 8, 4
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _audit_writes(root: str, seen: list[str]) -> None:
    root = os.path.realpath(root)

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path, mode, flags = args
        writing = (
            any(c in (mode or "") for c in "wax+") if mode else bool((flags or 0) & _WRITE_FLAGS)
        )
        full = os.path.realpath(os.fsdecode(path))
        if writing and (full == root or full.startswith(root + os.sep)):
            seen.append(full)

    sys.addaudithook(hook)


def main() -> int:
    save_dir, result_dir = sys.argv[1], sys.argv[2]
    import keras_sync

    sync = keras_sync.load(
        {
            "strategy": {"kind": "multi_worker_mirrored", "connect_timeout_s": 120},
            "batch": {"global": 32},
            "learning_rate": {"base": 0.01, "base_batch_size": 32},
            "mlflow": {"enabled": False},
        }
    )
    opens: list[str] = []
    _audit_writes(save_dir, opens)

    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(SAMPLES, 1))).astype("float32")
    probe = x[:16]
    with sync.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(sync.learning_rate, momentum=0.9),
            loss="mse",
            metrics=["mae"],
        )

    per_epoch: list = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):  # the weights ModelCheckpoint may have just saved
            per_epoch.append(self.model(probe).numpy().tolist())

    class Scribble(keras.callbacks.Callback):
        """A user's callback keras-sync does not know, guarded as docs/how-to/saving.md shows."""

        def on_train_end(self, logs=None):
            if sync.is_chief:
                with open(os.path.join(result_dir, "scribble.txt"), "w") as fh:
                    fh.write(f"done by worker {sync.task[1] or 0}")

    tensorboard = keras.callbacks.TensorBoard(os.path.join(save_dir, "tb"))
    csv_logger = keras.callbacks.CSVLogger(os.path.join(save_dir, "log.csv"))
    callbacks = [
        Record(),
        keras.callbacks.ModelCheckpoint(
            os.path.join(save_dir, "best.keras"), monitor="loss", save_best_only=True
        ),
        keras.callbacks.BackupAndRestore(os.path.join(save_dir, "keras_backup")),
        tensorboard,
        csv_logger,
        Scribble(),
    ]
    history = sync.fit(
        model,
        x,
        y,
        epochs=EPOCHS,
        verbose=0,
        callbacks=callbacks,
        validation_data=(x[:64], y[:64]),
    )
    # Where this worker's TensorBoard and CSVLogger wrote (the user's path on the chief only).
    wrote = {"tb": tensorboard.log_dir, "csv": csv_logger.filename}
    model.save(os.path.join(save_dir, "final.keras"))
    model.save_weights(os.path.join(save_dir, "final.weights.h5"))
    sync.save(model, os.path.join(save_dir, "explicit.keras"))
    task = sync.task[1] or 0
    os.makedirs(result_dir, exist_ok=True)
    with open(os.path.join(result_dir, f"w{task}.json"), "w") as f:
        json.dump(
            {
                "task": task,
                "is_chief": sync.is_chief,
                "num_workers": sync.num_workers,
                "loss": [float(v) for v in history.history["loss"]],
                "per_epoch": per_epoch,
                "final": model(probe).numpy().tolist(),
                "python_opens": opens,
                "callback_paths": wrote,
                "callback_paths_left": {k: os.path.exists(v) for k, v in wrote.items()},
            },
            f,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
