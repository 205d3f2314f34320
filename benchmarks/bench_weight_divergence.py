"""Per-epoch cost of `WeightDivergence` on a ~25M-parameter model: fingerprints vs whole variables.

Compares, in one process with `MirroredStrategy` over 2 logical CPUs, after one training step
(so the SGD momentum slots exist: ~50M mirrored floats per replica):
  fingerprints   keras-sync now: 4 float32 per variable and replica, one all_gather
  all_gather f64 the previous multi-worker path: every variable gathered as float64, one by one
  numpy f64      the previous single-process path: every copy fetched to host as float64

Each is called --repeats times after a warm-up call (tracing); the fastest call is compared
(this machine stalls for seconds at random, and the fastest call is the cost without the stall):

    .venv/bin/python benchmarks/bench_weight_divergence.py [--repeats 5] [--width 4096] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def old_allgather_fn(strategy, variables):
    """The previous multi-worker implementation (keras_sync before the fingerprints), verbatim."""
    import tensorflow as tf

    def replica_fn():
        ctx = tf.distribute.get_replica_context()
        worst = tf.constant(0.0, tf.float64)
        for v in variables:
            local = tf.cast(tf.reshape(tf.identity(v), [1, -1]), tf.float64)
            copies = ctx.all_gather(local, axis=0)
            worst = tf.maximum(
                worst, tf.reduce_max(tf.reduce_max(copies, 0) - tf.reduce_min(copies, 0))
            )
        return worst

    @tf.function
    def fn():
        return strategy.experimental_local_results(strategy.run(replica_fn))[0]

    return lambda: float(fn().numpy())


def old_numpy(strategy, variables):
    """The previous single-process implementation, verbatim."""
    import numpy as np

    worst = 0.0
    for v in variables:
        copies = [
            np.asarray(c.numpy(), dtype=np.float64) for c in strategy.experimental_local_results(v)
        ]
        stacked = np.stack(copies)
        worst = max(worst, float(np.max(stacked.max(axis=0) - stacked.min(axis=0), initial=0.0)))
    return worst


def timed(fn, repeats: int) -> tuple[float, float, object]:
    result = fn()  # warm-up: tracing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--width", type=int, default=4096, help="hidden width (4096: ~25M parameters)"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, width 64")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.width = 1, 64

    import keras_sync

    sync = keras_sync.load(
        {
            "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
            "batch": {"global": 8},
            "mlflow": {"enabled": False},
        }
    )
    import keras
    import numpy as np

    from keras_sync.callbacks.weight_divergence import _gather_fn, mirrored_variables
    from keras_sync.measures.fingerprints import summarize

    def compare(model):  # the callback's comparison, called directly
        return summarize(_gather_fn(model, mirrored_variables(model))().numpy().tolist())

    w = args.width
    with sync.scope():
        model = keras.Sequential(
            [
                keras.Input((2048,)),
                keras.layers.Dense(w, activation="relu"),
                keras.layers.Dense(w, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
    x = np.zeros((8, 2048), "float32")
    y = np.zeros((8, 10), "float32")
    model.fit(sync.distribute((x, y)), epochs=1, verbose=0)  # creates the momentum slots
    variables = mirrored_variables(model)
    floats = sum(int(v.shape.num_elements()) for v in variables)
    replicas = sync.num_replicas
    print(
        f"model: {model.count_params() / 1e6:.1f}M parameters; {len(variables)} mirrored variables, "
        f"{floats / 1e6:.1f}M floats per replica; {replicas} replicas"
    )

    rows = [
        ("fingerprints", lambda: compare(model).value, replicas * len(variables) * 4 * 4),
        ("all_gather f64", old_allgather_fn(sync.strategy, variables), replicas * floats * 8),
        ("numpy f64", lambda: old_numpy(sync.strategy, variables), replicas * floats * 8),
    ]
    results = {}
    for name, fn, moved in rows:
        best, median, value = timed(fn, args.repeats)
        results[name] = best
        print(
            f"{name:15s} fastest {best * 1000:9.1f} ms  median {median * 1000:9.1f} ms  "
            f"gathers {moved:>13,} bytes  value {value}"
        )
    new = results["fingerprints"]
    print(
        f"ratio fingerprints / all_gather f64 (the multi-worker path): {new / results['all_gather f64']:.3f}"
    )
    print(
        f"ratio fingerprints / numpy f64 (the single-process path):    {new / results['numpy f64']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
