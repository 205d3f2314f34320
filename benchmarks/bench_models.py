"""What keras-sync costs per training step on real models: `sync.fit` against plain Keras.

    .venv/bin/python benchmarks/bench_models.py [--rounds 5] [--models mobilenet_v2,transformer] [--quick]

Two models on 2 replicas (`MirroredStrategy` over 2 logical CPU devices), per-replica batch 32,
SGD with momentum at a fixed learning rate, synthetic data made in the script (nothing is
downloaded):

- ``mobilenet_v2``: `keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3),
  classes=10)` on random images and labels;
- ``transformer``: a small encoder (token and position embeddings, two blocks of
  `MultiHeadAttention` + `LayerNormalization` + feed-forward, mean pooling, a 10-way softmax) on
  random token ids.

Four variants, each in a fresh Python process, in an order that rotates from round to round:

- ``keras``: plain Keras, ``model.fit`` under a `MirroredStrategy` the script builds with the
  cross-device ops keras-sync picks on CPU (`ReductionToOneDevice`), so the strategy is the same;
- ``metrics_off``: `sync.fit` with ``mlflow.enabled: false``;
- ``default``: `sync.fit` with nothing set but the strategy, batch and learning rate (MLflow on,
  a fresh sqlite store in the process's temporary folder);
- ``every_step``: as ``default`` with ``mlflow.log_every_n_steps: 1``.

keras-sync is configured by a YAML file written beside each process (`keras_sync.load(path)`).
Each process fits one epoch of ``warm-up + timed`` steps; a callback reads the clocks at batch
ends, and the figures are those of the timed steps only (tracing and the first steps are left
out): the steady step time (wall clock) and the CPU seconds per step. CPU counts every thread of
the training process (`time.process_time`) plus its child processes (keras-sync's courier, which
delivers to MLflow) over the same steps, read with psutil at both ends of the timed steps; what a
process spends outside them (imports, tracing, the run's end, the exit) is left out, and shown
apart as the whole process's CPU (``resource.RUSAGE_CHILDREN`` of this script after the process
ended: the process and the descendants it waited for). Each process's line also gives the main
thread's CPU per step (`time.thread_time`), where keras-sync's Python work per step shows.

A round runs every variant of a model once; a variant's figure is the median over the rounds of
its ratio to plain Keras in the same round, with the range (min-max) over the rounds. On a shared
machine the wall-clock step time of one model moves by +-20% from process to process, so the CPU
ratio is the figure to trust.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

PER_REPLICA = 32
REPLICAS = 2
LEARNING_RATE = 0.01
# model: (warm-up steps, timed steps)
MODELS = {"mobilenet_v2": (20, 120), "transformer": (20, 300)}
VARIANTS = ("keras", "metrics_off", "default", "every_step")
#: --quick: a smoke run of keras-sync's code paths (``default`` differs from ``every_step`` by one YAML
#: line; MobileNetV2, plain Keras, takes ~100 s to trace in three processes).
QUICK = {"steps": (3, 10), "models": "transformer", "variants": "keras,metrics_off,every_step"}


def _keras_sync_config(variant: str, folder: str) -> str:
    """The YAML of a keras-sync variant, written into ``folder``; its path."""
    mlflow = (
        "  enabled: false\n"
        if variant == "metrics_off"
        else f"  tracking_uri: sqlite:///{folder}/mlflow.db\n  experiment: bench_models\n"
    )
    if variant == "every_step":
        mlflow += "  log_every_n_steps: 1\n"
    path = os.path.join(folder, "keras_sync.yaml")
    with open(path, "w") as fh:
        fh.write(
            "strategy:\n"
            "  kind: mirrored\n"
            f"  simulated_cpu_replicas: {REPLICAS}\n"
            f"batch:\n  per_replica: {PER_REPLICA}\n"
            f"learning_rate:\n  base: {LEARNING_RATE}\n  scaling: none\n"
            f"mlflow:\n{mlflow}"
        )
    return path


def _build_model(name: str, keras: Any) -> tuple:
    """The model (not compiled) and its inputs' shape and kind for ``name``."""
    if name == "mobilenet_v2":
        return keras.applications.MobileNetV2(
            weights=None, input_shape=(32, 32, 3), classes=10
        ), "images"
    seq, vocab, dim, heads, ff = 64, 2000, 64, 4, 128
    layers = keras.layers

    class AddPositions(layers.Layer):  # type: ignore[name-defined]
        """Adds a learned embedding of each position."""

        def build(self, shape: tuple) -> None:
            self.table = self.add_weight(shape=shape[1:], initializer="random_normal")

        def call(self, h: Any) -> Any:
            return h + self.table

    tokens = keras.Input((seq,), dtype="int32")
    h = AddPositions()(layers.Embedding(vocab, dim)(tokens))
    for _ in range(2):
        a = layers.MultiHeadAttention(heads, dim // heads)(h, h)
        h = layers.LayerNormalization()(h + a)
        f = layers.Dense(ff, activation="relu")(h)
        h = layers.LayerNormalization()(h + layers.Dense(dim)(f))
    out = layers.Dense(10, activation="softmax")(layers.GlobalAveragePooling1D()(h))
    return keras.Model(tokens, out), "tokens"


def _data(kind: str, n: int) -> tuple:
    import numpy as np

    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, size=(n,)).astype("int32")
    if kind == "images":
        return rng.normal(size=(n, 32, 32, 3)).astype("float32"), y
    return rng.integers(0, 2000, size=(n, 64)).astype("int32"), y


def child(args: argparse.Namespace) -> int:
    """One process: build ``args.model``, fit one epoch as ``args.variant``, write the figures."""
    started = time.perf_counter()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import psutil

    me = psutil.Process()

    def children_cpu() -> float:
        total = 0.0
        for p in me.children(recursive=True):
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    sync = None
    if args.variant == "keras":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS
        )
        strategy = tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(REPLICAS)],
            cross_device_ops=tf.distribute.ReductionToOneDevice(),
        )
        scope, lr = strategy.scope, LEARNING_RATE
    else:
        import keras_sync

        sync = keras_sync.load(_keras_sync_config(args.variant, os.getcwd()))
        scope, lr = sync.scope, sync.lr_schedule()
    import keras

    first, last = args.warmup - 1, args.warmup + args.steps - 1
    marks: dict = {}
    ends: list = []

    class Clock(keras.callbacks.Callback):
        """Reads the clocks at batch ends; the CPU ones only where the timed steps start and end."""

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            now = time.perf_counter()
            ends.append(now)
            if batch in (first, last):
                marks[batch] = (now, time.process_time(), children_cpu(), time.thread_time())

    keras.utils.set_random_seed(0)
    with scope():
        model, kind = _build_model(args.model, keras)
        model.compile(
            optimizer=keras.optimizers.SGD(lr, momentum=0.9),
            loss="sparse_categorical_crossentropy",
        )
    x, y = _data(kind, PER_REPLICA * REPLICAS * (last + 1))
    fit_kwargs = {"epochs": 1, "shuffle": False, "verbose": 0, "callbacks": [Clock()]}
    if sync is None:
        model.fit(x, y, batch_size=PER_REPLICA * REPLICAS, **fit_kwargs)
    else:
        sync.fit(model, x, y, **fit_kwargs)
    (t0, p0, c0, m0), (t1, p1, c1, m1) = marks[first], marks[last]
    steps = ends[first + 1 : last + 1]
    gaps = [b - a for a, b in zip(ends[first:last], steps)]
    with open(args.out, "w") as fh:
        json.dump(
            {
                "step_s": (t1 - t0) / args.steps,
                "median_step_s": statistics.median(gaps),
                "cpu_s": (p1 - p0 + c1 - c0) / args.steps,
                "courier_cpu_s": (c1 - c0) / args.steps,
                "main_thread_cpu_s": (m1 - m0) / args.steps,
                "to_timed_s": t0 - started,
                "run_id": getattr(sync, "run_id", None) if sync is not None else None,
            },
            fh,
        )
    return 0


def _child_env() -> dict:
    """This environment without what would send a benchmark process's run elsewhere."""
    drop = ("MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID", "KERAS_SYNC_CONFIG", "TF_CONFIG")
    return {k: v for k, v in os.environ.items() if k not in drop}


def run_one(model: str, variant: str, folder: str, warmup: int, steps: int) -> dict:
    """One fresh process of ``variant`` on ``model`` in ``folder``; its figures and whole-process CPU."""
    os.makedirs(folder)
    out = os.path.join(folder, "out.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model]
    cmd += ["--variant", variant, "--warmup", str(warmup), "--steps", str(steps), "--out", out]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(
        cmd, env=_child_env(), cwd=folder, capture_output=True, text=True, timeout=1800
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise RuntimeError(f"{model}/{variant} failed ({r.returncode}): {r.stderr[-3000:]}")
    with open(out) as fh:
        res = json.load(fh)
    res["process_s"] = time.perf_counter() - t0
    res["process_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if variant in ("default", "every_step"):
        res["points"] = _points_logged(folder)
    return res


def _points_logged(folder: str) -> int:
    """How many points of the chief's replica-0 loss the process's MLflow store holds."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
    exp = client.get_experiment_by_name("bench_models")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return sum(len(client.get_metric_history(r.info.run_id, "sync/loss/replica_0")) for r in runs)


def _spread(values: list) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def _table(got: dict, models: list, variants: list, quick_steps: int | None) -> str:
    """The ratios to plain Keras over the rounds run so far: median (min-max)."""
    lines = [
        "ratios to plain Keras in the same round: median (min-max over rounds); CPU = the training "
        "process's threads + its courier over the timed steps",
        f"{'model':<14}{'variant':<13}{'steps':>6}{'step ms':>9}{'CPU ms':>8}  "
        f"{'step ratio':<23}{'CPU ratio':<23}{'process CPU-s':>13}",
    ]
    for m in models:
        base = got[m, "keras"]
        for v in variants:
            rows = got[m, v][: len(base)]
            if not rows:
                continue
            step = [row["step_s"] / b["step_s"] for row, b in zip(rows, base)]
            cpu = [row["cpu_s"] / b["cpu_s"] for row, b in zip(rows, base)]
            ms = statistics.median(x["step_s"] for x in rows) * 1e3
            cms = statistics.median(x["cpu_s"] for x in rows) * 1e3
            pcpu = statistics.median(x["process_cpu_s"] for x in rows)
            ratios = ("-", "-")
            if v != "keras":
                ratios = (
                    f"{statistics.median(step):.3f}x ({_spread(step)})",
                    f"{statistics.median(cpu):.3f}x ({_spread(cpu)})",
                )
            steps = quick_steps or MODELS[m][1]
            lines.append(
                f"{m:<14}{v:<13}{steps:>6}{ms:>9.1f}{cms:>8.1f}  {ratios[0]:<23}{ratios[1]:<23}"
                f"{pcpu:>13.1f}"
            )
    lines.append("goal (issue 39): default at most 1.03x CPU per step on both models")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", default=None, help="default: all")
    ap.add_argument("--variants", default=None, help="keras is always included (default: all)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: 1 round, {QUICK['models']} ({QUICK['variants']}), 3 + 10 steps",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    rounds = 1 if args.quick else args.rounds
    models = (args.models or (QUICK["models"] if args.quick else ",".join(MODELS))).split(",")
    chosen = args.variants or (QUICK["variants"] if args.quick else ",".join(VARIANTS))
    variants = ["keras"] + [v for v in chosen.split(",") if v != "keras"]
    tmp = tempfile.mkdtemp(prefix="bench_models_")
    load0, started = os.getloadavg()[0], time.time()
    got: dict = {(m, v): [] for m in models for v in variants}
    for r in range(rounds):
        for m in models:
            warmup, steps = QUICK["steps"] if args.quick else MODELS[m]
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                res = run_one(m, v, os.path.join(tmp, f"{r}-{m}-{v}"), warmup, steps)
                got[m, v].append(res)
                print(
                    f"round {r + 1} {m:<13}{v:<12} step {res['step_s'] * 1e3:7.1f} ms "
                    f"(median {res['median_step_s'] * 1e3:.1f}), CPU {res['cpu_s'] * 1e3:7.1f} ms/step "
                    f"(courier {res['courier_cpu_s'] * 1e3:.1f}, main thread "
                    f"{res['main_thread_cpu_s'] * 1e3:.1f}); process {res['process_s']:.0f} s "
                    f"({res['to_timed_s']:.0f} s to the timed steps), "
                    f"{res['process_cpu_s']:.0f} CPU-s"
                    + (f"; {res['points']} points in MLflow" if "points" in res else ""),
                    file=sys.stderr,
                    flush=True,
                )
        if r + 1 < rounds:  # a long run on a busy machine: the figures so far
            print(_table(got, models, variants, None), file=sys.stderr, flush=True)

    import keras_sync

    print(
        f"\n2 replicas (MirroredStrategy, 2 logical CPUs), per-replica batch {PER_REPLICA}; {rounds} "
        f"round(s), a fresh process per variant; load average {load0:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end; {(time.time() - started) / 60:.1f} min "
        f"(keras-sync {keras_sync.__version__})"
    )
    print(_table(got, models, variants, QUICK["steps"][1] if args.quick else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
