"""Train steps per second with `runtime.steps_per_execution` 8 vs 1 on 2 simulated CPU replicas.

The ratio is the point, not the absolute numbers (a small model, where the per-call overhead
that steps_per_execution removes is a large part of a step). Both settings run in the same process,
alternating, several rounds; each round times the steps of one epoch between its first and last
callback (tracing and the epoch's teardown are outside the clock), and the best round counts:

    .venv/bin/python benchmarks/bench_steps_per_execution.py [--rounds 3] [--steps 400] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400, help="steps per timed epoch")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 16 steps")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 16

    import keras_sync

    base = {
        "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
        "batch": {"per_replica": 16},
        "learning_rate": {"base": 0.01, "scaling": "none"},
        "mlflow": {"enabled": False},
    }
    syncs = {
        spe: keras_sync.load({**base, "runtime": {"steps_per_execution": spe}}) for spe in (1, 8)
    }
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * args.steps, 8)).astype("float32")
    y = x[:, :1] * 2.0

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.marks = []

        def on_train_batch_end(self, batch, logs=None):
            self.marks.append((batch, time.perf_counter()))

    best: dict[int, float] = {}
    for _ in range(args.rounds):
        for spe, sync in syncs.items():
            with sync.scope():
                model = keras.Sequential(
                    [
                        keras.Input((8,)),
                        keras.layers.Dense(32, activation="relu"),
                        keras.layers.Dense(1),
                    ]
                )
                model.compile(optimizer=keras.optimizers.SGD(sync.lr_schedule()), loss="mse")
            clock = Clock()
            # Epoch 1 traces; epoch 2 is timed from its first callback to its last.
            sync.fit(model, sync.distribute((x, y)), epochs=2, verbose=0, callbacks=[clock])
            (b0, t0), (b1, t1) = clock.marks[0], clock.marks[-1]
            best[spe] = max(best.get(spe, 0.0), (b1 - b0) / (t1 - t0))
    for spe in sorted(best):
        print(
            f"steps_per_execution {spe}: {best[spe]:8.1f} steps/s (best of {args.rounds} rounds, 2 replicas)"
        )
    print(f"ratio spe 8 / spe 1: {best[8] / best[1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
