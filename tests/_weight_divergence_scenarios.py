"""WeightDivergence on real strategies, for tests/test_weight_divergence.py.

Usage: python _weight_divergence_scenarios.py mirrored OUT.json
       keras-sync launch --workers 2 _weight_divergence_scenarios.py multi_worker OUT_DIR
Trains a small model one epoch, then compares the replicas' copies; makes one replica's copy of a
variable differ (by 0.5 in one element, by one ulp, in the optimizer's step counter) and compares
again; then calls the callback in a fit. Writes what it saw as JSON (multi_worker: OUT_DIR/w<i>.json).
"""

from __future__ import annotations

import json
import os
import sys

MODE, OUT = sys.argv[1], sys.argv[2]

import keras_sync  # noqa: E402

strategy_cfg = (
    {"kind": "mirrored", "simulated_cpu_replicas": 2}
    if MODE == "mirrored"
    else {"kind": "multi_worker_mirrored", "connect_timeout_s": 120}
)
sync = keras_sync.load(
    {"strategy": strategy_cfg, "batch": {"global": 32}, "mlflow": {"enabled": False}}
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_sync.callbacks.weight_divergence import (  # noqa: E402
    WeightDivergence,
    _gather_fn,
    mirrored_variables,
)
from keras_sync.measures.fingerprints import summarize  # noqa: E402

task = sync.task[1] or 0
strategy = sync.strategy
rng = np.random.default_rng(0)
x = rng.normal(size=(128, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
with sync.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
model.fit(sync.distribute((x, y)), epochs=1, verbose=0)


def compare(model):
    """The replicas' copies of the model's mirrored variables compared now, [replicas, variables, 4]."""
    return summarize(_gather_fn(model, mirrored_variables(model))().numpy().tolist())


def as_dict(found):
    return {
        "value": found.value,
        "diverged": found.diverged_variables,
        "variables": found.variables,
    }


def local_copy(var, index):
    """This process's copy number `index` of a mirrored variable (Mirrored: one per device)."""
    return strategy.experimental_local_results(var)[index]


def exact_max_difference():
    """The previous metric, for comparison: max over variables of the element-wise spread (Mirrored only)."""
    worst = 0.0
    for v in mirrored_variables(model):
        copies = np.stack(
            [
                np.asarray(c.numpy(), dtype=np.float64)
                for c in strategy.experimental_local_results(v)
            ]
        )
        worst = max(worst, float(np.max(copies.max(axis=0) - copies.min(axis=0), initial=0.0)))
    return worst


result: dict = {
    "task": task,
    "replicas": sync.num_replicas,
    "names": [v.name for v in mirrored_variables(model)],
}
result["healthy"] = as_dict(compare(model))
kernel = model.layers[0].kernel.value  # the tf.Variable behind the Keras variable
iterations = model.optimizer.iterations.value
# Mirrored: change the second device's copy; multi-worker: change worker 1's (its only) copy.
victim, index = (True, 1) if MODE == "mirrored" else (task == 1, 0)
if victim:
    delta = np.zeros(kernel.shape, "float32")
    delta[0, 0] = 0.5
    local_copy(kernel, index).assign_add(delta)
result["one_element"] = as_dict(compare(model))
if MODE == "mirrored":
    result["one_element_exact"] = exact_max_difference()
    bias = model.layers[1].bias.value
    copy = local_copy(bias, index)
    copy.assign(np.nextafter(copy.numpy(), np.float32(np.inf)))  # one ulp up, every element
    result["one_ulp"] = as_dict(compare(model))
    result["one_ulp_exact"] = exact_max_difference()
    local_copy(iterations, index).assign_add(1)
    result["iterations"] = as_dict(compare(model))
    result["iterations_is_mirrored"] = any(v is iterations for v in mirrored_variables(model))
    for v in mirrored_variables(model):  # make the copies equal again
        for c in strategy.experimental_local_results(v)[1:]:
            c.assign(strategy.experimental_local_results(v)[0])
    result["restored"] = as_dict(compare(model))


class Recorder:
    """A writer that keeps what it is given (the callback only needs log_metrics)."""

    def __init__(self):
        self.logged = []

    def log_metrics(self, metrics, step):
        self.logged.append([metrics, step])


writer = Recorder() if sync.is_chief else None
model.fit(sync.distribute((x, y)), epochs=2, verbose=0, callbacks=[WeightDivergence(writer)])
result["callback"] = writer.logged if writer else None

if MODE == "mirrored":  # a sweep: several models in one process, each compared once
    import logging

    warned = []

    class _Keep(logging.Handler):
        def emit(self, record):
            warned.append(record.getMessage())

    logging.getLogger("tensorflow").addHandler(_Keep())
    values = []
    for i in range(7):
        with sync.scope():
            other = keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(4 + i), keras.layers.Dense(1)]
            )
            other.compile(optimizer="sgd", loss="mse")
        values.append(compare(other).value)
    result["sweep"] = {
        "values": values,
        "retracing_warnings": [w for w in warned if "retracing" in w],
    }

    # What the first epoch end costs grows with the ops of the traced comparison: ops per variable,
    # from two models of 10 and 50 mirrored variables (traced only).
    from keras_sync.callbacks.weight_divergence import _gather_fn

    ops = {}
    for layers in (1, 11):
        with sync.scope():
            deep = keras.Sequential(
                [keras.Input((8,))]
                + [keras.layers.Dense(4) for _ in range(layers)]
                + [keras.layers.Dense(1)]
            )
            deep.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
            deep.optimizer.build(deep.trainable_variables)
        deep_vars = mirrored_variables(deep)
        ops[len(deep_vars)] = len(
            _gather_fn(deep, deep_vars).get_concrete_function().graph.get_operations()
        )
    (few, few_ops), (many, many_ops) = sorted(ops.items())
    result["ops_per_variable"] = {
        "variables": [few, many],
        "per_variable": (many_ops - few_ops) / (many - few),
    }

    # sync.fit builds its callbacks anew at each fit: one model's comparison is still traced once.
    from keras_sync.training.instrument import probe_of

    with sync.scope():
        again = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        again.compile(optimizer="sgd", loss="mse")
    logged = Recorder()
    for _ in range(2):
        sync.fit(again, x, y, epochs=1, verbose=0, callbacks=[WeightDivergence(logged)])
    kept = probe_of(again).weight_gather
    result["two_fits"] = {
        "points": len(logged.logged),
        "traces": kept[1].experimental_get_tracing_count() if kept else None,
    }

if MODE == "mirrored":
    path = OUT
else:
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, f"w{task}.json")
with open(path, "w") as f:
    json.dump(result, f)
