"""Training-step scenarios on real strategies, one process per device layout (logical devices are fixed per process).

Usage:
    python _runtime_scenarios.py replicas N [TRACKING_URI] OUT.json
                                                          N simulated CPU replicas (1: one device)
    keras-sync launch --workers 2 _runtime_scenarios.py workers [TRACKING_URI] OUT.json
                                                          2 workers x 1 CPU (MWMS); the chief writes
    keras-sync launch --workers 2 _runtime_scenarios.py workers_x2 OUT.json
                                                          2 workers x 2 simulated CPU replicas (MWMS over
                                                          4 replicas): steps_per_execution and accumulation only
Every scenario trains the same model from the same seed on the same global batches and records its
final weights (and what keras-sync saw), so tests/test_runtime.py compares layouts with one device.
With TRACKING_URI the steps_per_execution scenario logs its sync metrics there.
The workers build ONE MultiWorkerMirroredStrategy and train every model under it (see `load`).
"""

from __future__ import annotations

import sys

import numpy as np
from _scenario import Results

import keras_sync

MODE, OUT = sys.argv[1], sys.argv[-1]
WORKERS = MODE.startswith("workers")
N = int(sys.argv[2]) if MODE == "replicas" else 2 if MODE == "workers_x2" else 0
_rest = sys.argv[3 if MODE == "replicas" else 2 : -1]
TRACKING_URI = _rest[0] if _rest else None
GLOBAL_BATCH = 64
results = Results()
record = results.record
rng = np.random.default_rng(0)
X = rng.normal(size=(512, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(512, 1))).astype("float32")


def config(**runtime):
    if WORKERS:
        strategy = {"kind": "multi_worker_mirrored", **({"simulated_cpu_replicas": N} if N else {})}
    elif N > 1:
        strategy = {"kind": "mirrored", "simulated_cpu_replicas": N}
    else:
        strategy = {"kind": "one_device"}
    return {
        "strategy": strategy,
        "batch": {"global": GLOBAL_BATCH},
        "learning_rate": {"base": 0.05, "scaling": "none"},
        "mlflow": {"enabled": False},
        "runtime": runtime,
    }


SYNC = keras_sync.load(config())


def load(cfg):
    """keras_sync.load, except that the workers keep their one MultiWorkerMirroredStrategy.

    (Several MWMS strategies in one process made later fits fail here with collective errors
    between the workers: "Delete called on non-empty BufRendezvous"; one strategy per process.)
    """
    if not WORKERS:
        return keras_sync.load(cfg)
    import types

    from keras_sync.config import load_config
    from keras_sync.session import Sync
    from keras_sync.training import runtime

    config = load_config(cfg)
    runtime.set_dtype_policy(config)  # what keras_sync.load does (runtime.mixed_precision)
    return Sync(config, SYNC.strategy, types.SimpleNamespace(kind=SYNC.kind))


import keras  # noqa: E402  (after load: devices and cluster are set up by then)
import tensorflow as tf  # noqa: E402


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()]).tolist()


# -- custom train_step (issue 12, item 4) ---------------------------------------------------------


class GuideStep(keras.Sequential):
    """As the Keras 3 guides write it: a tape, keras.ops.mean of a loss function, apply_gradients."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.losses.mean_squared_error(y, self(x, training=True)))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


class ComputeLossStep(keras.Sequential):
    """compute_loss (Keras divides by the replica count) and optimizer.apply."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply(grads, self.trainable_weights)
        return {"loss": loss}


class DividedStep(keras.Sequential):
    """The user divides by num_replicas_in_sync, as tf.distribute tutorials teach."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.losses.mean_squared_error(y, self(x, training=True)))
            loss = loss / self.distribute_strategy.num_replicas_in_sync
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


class AverageLossStep(keras.Sequential):
    """tf.nn.compute_average_loss with an explicit global batch size."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            per_example = keras.losses.mean_squared_error(y, self(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


class SumLossStep(keras.Sequential):
    """A Keras loss object with reduction="sum" over the replica's batch, divided by the global batch."""

    sum_loss = keras.losses.MeanSquaredError(reduction="sum")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.sum_loss(y, self(x, training=True)) / GLOBAL_BATCH
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


class TwoOptimizers(keras.Model):
    """A GAN's step (issue 23): the discriminator's loss from a loss object, the generator's a manual -mean."""

    def __init__(self):
        super().__init__()
        self.disc = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
        )
        self.gen = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, x):
        return self.disc(x)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def train_step(self, data):
        x, _ = data
        z = x[:, :4]  # the "noise" comes from the data: the same on every layout
        with tf.GradientTape() as tape:
            logits = self.disc(keras.ops.concatenate([x, self.gen(z)], 0))
            labels = keras.ops.concatenate(
                [keras.ops.ones_like(x[:, :1]), keras.ops.zeros_like(x[:, :1])], 0
            )
            d_loss = self.bce(labels, logits)
        grads = tape.gradient(d_loss, self.disc.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.disc.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = -keras.ops.mean(self.disc(self.gen(z)))
        grads = tape.gradient(g_loss, self.gen.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.gen.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


class ActivitySum(keras.layers.Layer):
    """add_loss(rate * ops.sum(x)): a sum over the batch (issue 23)."""

    def call(self, x):
        self.add_loss(1e-3 * keras.ops.sum(x))
        return x


class ActivityMean(keras.layers.Layer):
    """The same term written as a mean times the global batch (what the add_loss check's line advises)."""

    def call(self, x):
        self.add_loss(1e-3 * GLOBAL_BATCH * keras.ops.mean(keras.ops.sum(x, axis=-1)))
        return x


def add_loss_model(layer, sync=None):
    keras.utils.set_random_seed(0)
    with (sync or SYNC).scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="tanh"),
                layer(),
                keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def add_loss_checks(tracking_uri=None):
    """The add_loss check with an MLflow run (its tag) and with checks.on_violation: error (the fit stops)."""
    out = {}
    if tracking_uri:
        s = load(
            {
                **config(),
                "mlflow": {"enabled": True, "tracking_uri": tracking_uri, "experiment": "add_loss"},
            }
        )
        model = add_loss_model(ActivitySum, s)
        s.fit(model, X, Y, epochs=1, shuffle=False, verbose=0)
        writer = s.job_run.current
        s.close(timeout_s=300)
        out["run_id"] = writer.run_id if writer is not None else None
    s = load({**config(), "checks": {"on_violation": "error"}})
    model = add_loss_model(ActivitySum, s)
    try:
        s.fit(model, X, Y, epochs=1, shuffle=False, verbose=0)
        out["error"] = None
    except keras_sync.KerasSyncError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["iterations"] = int(model.optimizer.iterations.numpy())
    return out


def make(cls, sync=None, optimizer=None, **compile_kwargs):
    sync = sync or SYNC
    keras.utils.set_random_seed(0)
    with sync.scope():
        model = cls(
            [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
        )
        model.compile(
            optimizer=optimizer or keras.optimizers.SGD(sync.lr_schedule(), momentum=0.9),
            loss="mse",
            **compile_kwargs,
        )
    return model


def trace_of(probe):
    """What replica 0's last trace decided: its first apply's, and each optimizer's when several."""
    applies = probe.applies
    out = {"scaled_by": applies[0]["scaled_by"], "factor": applies[0]["factor"]} if applies else {}
    if len({a["optimizer"] for a in applies}) > 1:
        out["per_optimizer"] = {a["optimizer"]: [a["scaled_by"], a["factor"]] for a in applies}
    return out


def custom_steps():
    from keras_sync.training import instrument as _instrument

    out = {}
    for name, cls in [
        ("keras", keras.Sequential),
        ("guide", GuideStep),
        ("compute_loss", ComputeLossStep),
        ("divided", DividedStep),
        ("average_loss", AverageLossStep),
    ]:
        model = make(cls)
        probe = _instrument.instrument(
            model
        )  # the per-replica values of every step (the default step too)
        SYNC.fit(model, X, Y, epochs=2, shuffle=False, verbose=0)
        rings = probe.read()
        steps = probe.count(rings)
        rows = [probe.row(rings, c) for c in range(max(1, steps - probe.ring + 1), steps + 1)]
        out[name] = {
            "weights": flat(model),
            "trace": trace_of(probe),
            "steps": steps,
            "loss": [[float(r[probe.LOSS]) for r in rs] for rs in rows],
            "grad_norm": [[float(r[probe.GRAD_NORM]) for r in rs] for rs in rows],
        }
    model = make(SumLossStep)
    probe = _instrument.instrument(model)
    SYNC.fit(model, X, Y, epochs=2, shuffle=False, verbose=0)
    out["sum_loss"] = {"weights": flat(model), "trace": trace_of(probe)}
    keras.utils.set_random_seed(0)
    with SYNC.scope():
        gan = TwoOptimizers()
        gan.compile(
            keras.optimizers.SGD(0.02, momentum=0.9), keras.optimizers.SGD(0.02, momentum=0.9)
        )
    probe = _instrument.instrument(gan)
    SYNC.fit(gan, X, Y, epochs=2, shuffle=False, verbose=0)
    out["two_optimizers"] = {"weights": flat(gan), "trace": trace_of(probe)}
    for name, layer in (("add_loss_sum", ActivitySum), ("add_loss_mean", ActivityMean)):
        model = add_loss_model(layer)
        SYNC.fit(model, X, Y, epochs=2, shuffle=False, verbose=0)
        out[name] = {"weights": flat(model)}
    # Keras's behaviour on request: the guide's step with its gradients summed.
    s = load(config(train_step_gradients="sum"))
    model = make(GuideStep, s)
    s.fit(model, X, Y, epochs=2, shuffle=False, verbose=0)
    out["guide_sum"] = {"weights": flat(model)}
    return out


if MODE != "workers_x2":
    record("custom_steps", custom_steps)


# -- runtime section (issue 13) --------------------------------------------------------------------


def spe(tracking_uri=None):
    """steps_per_execution 4 from the YAML (the compile line says nothing): same weights as 1."""
    mlflow = (
        {"enabled": True, "tracking_uri": tracking_uri, "experiment": "spe", "log_every_n_steps": 1}
        if tracking_uri
        else {"enabled": False}
    )
    s = load({**config(steps_per_execution=4), "mlflow": mlflow})
    model = make(keras.Sequential, s)
    try:
        s.fit(model, X, Y, epochs=2, shuffle=False, verbose=0)
    except keras_sync.KerasSyncError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    out = {
        "weights": flat(model),
        "spe": int(model.steps_per_execution),
        "iterations": int(model.optimizer.iterations.numpy()),
    }
    if tracking_uri:
        writer = s.job_run.current  # the chief's (only the chief logs)
        s.close(timeout_s=300)  # the writer's thread creates the run: its id is known after close
        out["run_id"] = writer.run_id if writer is not None else None
    return out


def accumulation():
    """gradient_accumulation_steps 2 at per-replica 8 == per-replica 16 without accumulation."""
    out = {}
    for opt in ("sgd", "adam"):
        for name, batch, acc in (("acc", 8, 2), ("ref", 16, 1)):
            per = {
                "batch": {"per_replica": batch},
                "learning_rate": {"base": 0.01, "base_batch_size": 16, "scaling": "linear"},
            }
            s = load({**config(gradient_accumulation_steps=acc), **per})
            with s.scope():  # a TensorFlow optimizer belongs to the strategy it is made under
                optimizer = (
                    keras.optimizers.SGD(s.lr_schedule(), momentum=0.9)
                    if opt == "sgd"
                    else keras.optimizers.Adam(s.lr_schedule())
                )
            model = make(keras.Sequential, s, optimizer=optimizer)
            try:
                s.fit(model, X, Y, epochs=2, shuffle=False, verbose=0)
            except keras_sync.KerasSyncError as exc:
                out[f"{opt}_{name}"] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            out[f"{opt}_{name}"] = {
                "weights": flat(model),
                "lr": s.learning_rate,
                "effective": s.effective_batch_size,
                "iterations": int(model.optimizer.iterations.numpy()),
            }
    return out


def optimizer_options():
    """Gradient clipping (Keras clips each replica's share before it all-reduces) and the options that crash."""
    out = {}
    for name, kwargs in (
        ("none", {}),
        ("clipnorm", {"clipnorm": 0.05}),
        ("global_clipnorm", {"global_clipnorm": 0.05}),
        ("clipvalue", {"clipvalue": 0.01}),
    ):
        with SYNC.scope():
            optimizer = keras.optimizers.SGD(SYNC.lr_schedule(), momentum=0.9, **kwargs)
        model = make(keras.Sequential, optimizer=optimizer)
        SYNC.fit(model, X, Y, epochs=2, shuffle=False, verbose=0)
        out[name] = flat(model)
    # An embedding's gradient is an IndexedSlices: one device clips its rows (repeated ids apart).
    ids = (np.abs(X) * 10).astype("int32") % 50
    for name, kwargs in (("embedding_none", {}), ("embedding_clipnorm", {"clipnorm": 0.05})):
        keras.utils.set_random_seed(0)
        with SYNC.scope():
            model = keras.Sequential(
                [
                    keras.Input((8,), dtype="int32"),
                    keras.layers.Embedding(50, 4),
                    keras.layers.Flatten(),
                    keras.layers.Dense(1),
                ]
            )
            model.compile(
                optimizer=keras.optimizers.SGD(SYNC.lr_schedule(), momentum=0.9, **kwargs),
                loss="mse",
            )
        SYNC.fit(model, ids, Y, epochs=2, shuffle=False, verbose=0)
        out[name] = flat(model)
    for name, kwargs in (
        ("gradient_accumulation_steps", {"gradient_accumulation_steps": 2}),
        ("use_ema", {"use_ema": True}),
    ):
        with SYNC.scope():
            optimizer = keras.optimizers.SGD(0.01, **kwargs)
        try:
            SYNC.fit(make(keras.Sequential, optimizer=optimizer), X, Y, epochs=1, verbose=0)
            out[name] = "trained"
        except keras_sync.KerasSyncError as exc:
            out[name] = str(exc)
    return out


def bn_model(s):
    keras.utils.set_random_seed(0)
    with s.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16),
                keras.layers.BatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def sync_bn():
    out = {}
    for on in (True, False):
        s = load(config(sync_batch_norm=on))
        model = bn_model(s)
        s.fit(model, X, Y, epochs=2, shuffle=False, verbose=0)
        out["on" if on else "off"] = {
            "weights": flat(model),
            "synchronized": bool(model.layers[1].synchronized),
        }
        if WORKERS:
            break
    return out


def mixed():
    """mixed precision from the YAML on a model built after load(); gradient norms against float32."""
    from keras_sync.training import instrument as _instrument

    out = {}
    for policy in ("mixed_bfloat16", "mixed_float16", "none"):
        s = load(config(mixed_precision=policy))
        model = make(keras.Sequential, s)
        probe = _instrument.instrument(model)
        h = s.fit(model, X, Y, epochs=2, shuffle=False, verbose=0)
        rings = probe.read()
        rows = [probe.row(rings, c) for c in range(1, probe.count(rings) + 1)]
        out[policy] = {
            "policy": model.layers[0].dtype_policy.name,
            "compute": model.layers[0].compute_dtype,
            "variable": model.layers[0].variable_dtype,
            "optimizer": type(model.optimizer).__name__,
            "loss": h.history["loss"],
            "grad_norm": [float(r[0][probe.GRAD_NORM]) for r in rows],
            "loss_scale": [float(r[0][probe.LOSS_SCALE]) for r in rows],
        }
    return out


class ScaleLossStep(keras.Sequential):
    """mixed_float16 as Keras asks (issue 23): gradients of `optimizer.scale_loss(loss)`, a manual mean."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.losses.mean_squared_error(y, self(x, training=True)))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


class HalvesStep(keras.Sequential):
    """One device, mixed_float16: Keras's step with its float16 gradients computed on the two halves of the batch
    that 2 replicas get, summed in float32, and one device's skip rule (a sum float16 rounds to inf skips): what
    the float16 rounding of the replica split alone changes."""

    def train_step(self, data):
        x, y = data
        half = GLOBAL_BATCH // 2
        total = None
        for part in (slice(0, half), slice(half, None)):
            with tf.GradientTape() as tape:
                loss = (
                    keras.ops.mean(
                        keras.losses.mean_squared_error(y[part], self(x[part], training=True))
                    )
                    / 2
                )
                scaled = self.optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, self.trainable_weights)
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        skip = tf.reduce_any([tf.reduce_any(tf.abs(g) >= 65520.0) for g in total])
        total = [tf.where(skip, tf.fill(tf.shape(g), float("nan")), g) for g in total]
        self.optimizer.apply_gradients(zip(total, self.trainable_weights))
        return {"loss": loss}  # Keras's TF trainer refuses a step that returns no logs


#: The first batch's second half is float16's inf: only the second replica's gradients are not finite.
X_OVERFLOW = X.copy()
X_OVERFLOW[GLOBAL_BATCH // 2 : GLOBAL_BATCH] *= 1e5


def mixed_custom():
    """mixed_float16: Keras's own step and a custom step that scales its loss: updates applied, final scale, weights.

    ``second_replica_overflows``: Keras's step on data whose first batch overflows on the second replica only.
    """
    out = {}
    cases = [
        ("keras", keras.Sequential, X),
        ("scale_loss", ScaleLossStep, X),
        ("second_replica_overflows", keras.Sequential, X_OVERFLOW),
    ]
    if N == 1 and not WORKERS:
        cases.append(("halves", HalvesStep, X))
    for name, cls, x in cases:
        s = load(config(mixed_precision="mixed_float16"))
        model = make(cls, s)
        s.fit(model, x, Y, epochs=4, shuffle=False, verbose=0)
        opt = model.optimizer
        out[name] = {
            "weights": flat(model),
            "updates": int(opt.iterations.numpy()),
            "scale": float(opt.dynamic_scale.numpy()),
        }
    if (
        N > 1 or WORKERS
    ):  # a Keras that moved the pass-through: the sum on replica 0, zeros elsewhere
        from keras_sync.upstream import keras_fixes

        passing = keras_fixes.sums_pass_through
        keras_fixes.sums_pass_through = lambda optimizer: None
        try:
            s = load(config(mixed_precision="mixed_float16"))
            model = make(keras.Sequential, s)
            s.fit(model, X, Y, epochs=4, shuffle=False, verbose=0)
            out["keras_reduced_twice"] = {
                "weights": flat(model),
                "updates": int(model.optimizer.iterations.numpy()),
                "scale": float(model.optimizer.dynamic_scale.numpy()),
            }
        finally:
            keras_fixes.sums_pass_through = passing
    return out


def jit():
    out = {}
    for value in (True, False):
        s = load(config(jit_compile=value))
        model = make(keras.Sequential, s)
        try:
            s.fit(model, X, Y, epochs=1, shuffle=False, verbose=0)
        except keras_sync.KerasSyncError as exc:
            out[str(value)] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        out[str(value)] = {"weights": flat(model), "jit": bool(model.jit_compile)}
    return out


def step_dtypes(timed=True):
    """Every dtype in the graph of an instrumented train step. keras-sync adds no float64 where there is
    none (a TPU): its only float64 are the slow-worker timestamps (``tf.timestamp``), which it leaves out
    on a TPU and under XLA (``probe.timed``)."""
    from keras_sync.training import instrument as _instrument

    model = make(GuideStep)
    with SYNC.scope():
        model.optimizer.build(model.trainable_variables)  # its variables exist before the trace
    _instrument.instrument(model, gradients="auto")
    _instrument.probe_of(model).timed = timed
    ds = SYNC.strategy.experimental_distribute_dataset(SYNC.distribute((X, Y)))
    batch = next(iter(ds))

    @tf.function
    def step(data):
        return SYNC.strategy.run(model.train_step, args=(data,))

    graph = step.get_concrete_function(batch).graph.as_graph_def()
    dtypes = set()
    for node in [*graph.node, *(n for f in graph.library.function for n in f.node_def)]:
        for key in ("T", "dtype", "DstT", "SrcT", "out_type", "Tout"):
            if key in node.attr and node.attr[key].type:
                dtypes.add(tf.dtypes.as_dtype(node.attr[key].type).name)
    return sorted(dtypes)


record("spe", lambda: spe(TRACKING_URI))
if N > 1 and not WORKERS:
    record("add_loss_checks", lambda: add_loss_checks(TRACKING_URI))
record("accumulation", accumulation)
if MODE != "workers_x2":
    record("optimizer_options", optimizer_options)
if MODE != "workers_x2":
    record("sync_bn", sync_bn)
    record("jit", jit)
if MODE != "workers_x2":
    record("mixed_custom", mixed_custom)
    keras.mixed_precision.set_dtype_policy("float32")
if N > 1 and not WORKERS:
    record("mixed", mixed)
    keras.mixed_precision.set_dtype_policy("float32")
    record("dtypes", step_dtypes)
    record("dtypes_untimed", lambda: step_dtypes(timed=False))

if MODE == "replicas" or SYNC.is_chief:
    results.update(num_replicas=SYNC.num_replicas, num_workers=SYNC.num_workers)
    results.dump(OUT)
