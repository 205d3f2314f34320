"""A 2-worker script for tests/test_collective_calls.py: predict/evaluate after training.

Usage: python _collective_train.py MODE OUT_DIR   (under `keras-sync launch`)
MODE: ``every_worker`` (sync.predict, model.predict and sync.evaluate on every worker, a record of
keras.Model's fit/evaluate/predict, then the chief
alone works on for CHIEF_EXTRA_S: longer than TensorFlow's heartbeat timeout, so a worker that
left at once would be reported unhealthy), ``chief_only`` (``if sync.is_chief: model.predict``), or
``worker_vanishes`` (worker 1 leaves with ``os._exit`` as soon as its `sync.fit` returns, skipping its
exit meeting; it exits 3 if the chief's fit had not ended by then; the chief records when its
script ended).
Worker i writes OUT_DIR/w<i>.json with what it computed.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
CHIEF_EXTRA_S = 25.0


def main() -> int:
    mode, out_dir = sys.argv[1], sys.argv[2]
    import keras_sync

    sync = keras_sync.load(
        {
            "strategy": {"kind": "multi_worker_mirrored", "connect_timeout_s": 120},
            "batch": {"global": 32},
            "mlflow": {"enabled": False},
        }
    )
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    with sync.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    done = os.path.join(out_dir, "chief_fit_ended")
    callbacks = []
    if mode == "worker_vanishes" and sync.is_chief:
        # The chief is past its last collective but still inside fit for a while.
        def end(logs):
            time.sleep(2.0)
            os.makedirs(out_dir, exist_ok=True)
            open(done, "w").close()

        callbacks.append(keras.callbacks.LambdaCallback(on_train_end=end))
    sync.fit(model, x, y, epochs=1, verbose=0, callbacks=callbacks)
    task = sync.task[1] or 0
    out: dict = {"task": task}
    if mode == "every_worker":
        out["sync_predict"] = sync.predict(model, x[:64], verbose=0).tolist()
        out["model_predict"] = model.predict(x[:64], verbose=0).tolist()
        out["local"] = model(x[:64]).numpy().tolist()
        out["evaluate"] = float(sync.evaluate(model, x, y, verbose=0))
        # Checked per model: keras.Model's fit/evaluate/predict stay Keras's own after load() and fit.
        out["keras_model_methods"] = {
            name: [name in vars(keras.Model), getattr(keras.Model, name).__code__.co_filename]
            for name in ("fit", "evaluate", "predict")
        }
        if sync.is_chief:
            time.sleep(CHIEF_EXTRA_S)
    elif mode == "worker_vanishes":
        # sync.fit returns on a worker once every worker's fit has ended: leaving at once cannot
        # break a peer that still fetches this worker's part of fit's last collective.
        if not sync.is_chief:
            os._exit(0 if os.path.exists(done) else 3)
        out["ended"] = time.time()
    elif mode == "chief_only" and sync.is_chief:
        started = time.monotonic()
        try:
            model.predict(x[:64], verbose=0)
        finally:
            out["predict_s"] = time.monotonic() - started
            _write(out_dir, task, out)
    _write(out_dir, task, out)
    print(f"worker {task} done", flush=True)
    return 0


def _write(out_dir: str, task: int, out: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"w{task}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    sys.exit(main())
