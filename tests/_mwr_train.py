"""A keras-sync training script for tests/test_multi_worker.py and tests/test_resume.py.

Usage: python _mwr_train.py CONFIG_JSON OUT_DIR [--kill-at STEP --kill-task I ... --marker FILE]
              [--term-at STEP [--in-collective]] [--wait-at STEP --wait-for FILE [--step-file FILE]]
              [--hold-at STEP --marker FILE]
              [--epochs N] [--no-shuffle] [--samples N]

CONFIG_JSON is a keras-sync config as JSON text (a dict, as keras_sync.load takes). Runs under
`keras-sync launch` (TF_CONFIG set) or alone. Prints ``step <optimizer step> epoch <e> batch <b>``
after every batch; worker I writes OUT_DIR/w<I>.json with the final weights, the replica count,
the epoch losses and where it resumed. With --kill-at, task I sends itself SIGKILL after that
optimizer step, once (the marker file records that it happened), as a preemption would. Both may
be repeated (the k-th --kill-at goes with the k-th --kill-task, task 0 when not given; marker
FILE for the first, FILE.<k> for the others): one job killed again after each relaunch.
With --term-at, task I gets SIGTERM while it trains that step instead (once, same marker): sent
by itself just before the step, or with --in-collective by a child process 0.5 s later while
the other workers hold that step back 2 s, so the signal lands inside the step's all-reduce.
With --wait-at, every worker waits after that step until FILE exists (a test cuts a link then).
With --hold-at, every worker prints ``holding after step N`` after that step and waits there until
it has received a SIGTERM or SIGINT from outside (keras-sync's handler recorded it; without a
backup_dir, until SIGINT's KeyboardInterrupt), once (marker FILE.<task>): a scheduler's signal or
a Ctrl-C then lands at a known step however slow its delivery.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAMPLES = 256
FEATURES = 8


def _hold_until_signal(step: int, limit_s: float = 900) -> None:
    # keras-sync's SIGTERM/SIGINT handler (installed by fit with a backup_dir) is a bound method of
    # keras_sync.cluster.preemption.PreemptionSaver: its `pending` turns True when a signal has arrived.
    watch = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    print(f"holding after step {step}", flush=True)
    deadline = time.monotonic() + limit_s
    while not getattr(
        watch, "pending", False
    ):  # without the handler, SIGINT raises KeyboardInterrupt here
        if time.monotonic() > deadline:
            raise SystemExit(f"--hold-at: no SIGTERM within {limit_s:g} s")
        time.sleep(0.02)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("out_dir")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--kill-at", type=int, action="append", default=[])
    p.add_argument("--kill-task", type=int, action="append", default=[])
    p.add_argument("--marker", default=None)
    p.add_argument("--term-at", type=int, default=None)
    p.add_argument("--in-collective", action="store_true")
    p.add_argument("--samples", type=int, default=SAMPLES)
    p.add_argument("--wait-at", type=int, default=None)
    p.add_argument("--wait-for", default=None)
    p.add_argument(
        "--step-file", default=None, help="with --wait-at: created when that step is reached"
    )
    p.add_argument("--hold-at", type=int, default=None)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument(
        "--dropout", type=float, default=0.0, help="a Dropout layer: its seed state must resume too"
    )
    ns = p.parse_args()
    kills = [
        (
            at,
            ns.kill_task[k] if k < len(ns.kill_task) else 0,
            ns.marker if k == 0 else f"{ns.marker}.{k}",
        )
        for k, at in enumerate(ns.kill_at)
    ]
    ns.kill_task = ns.kill_task[0] if ns.kill_task else 0  # the task --term-at signals
    started = time.monotonic()

    import keras_sync

    sync = keras_sync.load(json.loads(ns.config))
    task = sync.task[1] or 0

    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ns.samples, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(ns.samples, 1))).astype(
        "float32"
    )

    with sync.scope():
        keras.utils.set_random_seed(0)
        dropout = [keras.layers.Dropout(ns.dropout)] if ns.dropout else []
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="relu"),
                *dropout,
                keras.layers.Dense(1),
            ]
        )
        # Momentum: a resume that lost the optimizer state would show in the weights.
        model.compile(
            optimizer=keras.optimizers.SGD(sync.learning_rate, momentum=0.9),
            loss="mse",
            metrics=["mae"],
        )

    start: dict = {}

    class Report(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            print(f"step {step} epoch {self._epoch} batch {batch}", flush=True)
            for at, victim, marker in kills:
                if at == step and task == victim and ns.marker and not os.path.exists(marker):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
            if ns.wait_at == step:
                if ns.step_file:
                    open(ns.step_file, "w").close()
                while not os.path.exists(ns.wait_for):
                    time.sleep(0.05)
            if ns.hold_at == step and ns.marker and not os.path.exists(f"{ns.marker}.{task}"):
                open(f"{ns.marker}.{task}", "w").close()
                _hold_until_signal(step)

        def on_train_batch_begin(self, batch, logs=None):
            if ns.term_at is None or int(self.model.optimizer.iterations.numpy()) != ns.term_at - 1:
                return
            if task != ns.kill_task:
                if ns.in_collective and ns.marker and not os.path.exists(ns.marker + ".held"):
                    open(ns.marker + ".held", "w").close()
                    time.sleep(
                        2.0
                    )  # the signalled worker waits for us inside the step's all-reduce
                return
            if ns.marker and not os.path.exists(ns.marker):
                open(ns.marker, "w").close()
                print(f"sigterm before step {ns.term_at}", flush=True)
                if ns.in_collective:
                    subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -TERM {os.getpid()}"])
                else:
                    os.kill(os.getpid(), signal.SIGTERM)

        def on_train_begin(self, logs=None):
            # The backup callback runs first: a resumed job shows its restored step here already.
            start["iterations"] = int(self.model.optimizer.iterations.numpy())

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch
            start.setdefault("epoch", epoch)

    history = sync.fit(
        model, x, y, epochs=ns.epochs, shuffle=not ns.no_shuffle, verbose=0, callbacks=[Report()]
    )
    result = {
        "task": task,
        "num_replicas": sync.num_replicas,
        "num_workers": sync.num_workers,
        "weights": [w.tolist() for w in model.get_weights()],
        "loss": [float(v) for v in history.history["loss"]],
        "epochs_run": history.epoch,
        "iterations": int(model.optimizer.iterations.numpy()),
        "start": start,
        "elapsed_s": time.monotonic() - started,
        "env": {k: os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_STEP_ID")},
        # keras-sync handles SIGTERM and SIGINT only while fit runs: afterwards, Python's own handlers.
        "signals_restored": signal.getsignal(signal.SIGINT) is signal.default_int_handler
        and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None),
    }
    resolver = getattr(sync.strategy, "cluster_resolver", None)
    if resolver is not None:  # the addresses the workers really listened on
        result["cluster"] = resolver.cluster_spec().as_dict()
    os.makedirs(ns.out_dir, exist_ok=True)
    with open(os.path.join(ns.out_dir, f"w{task}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
