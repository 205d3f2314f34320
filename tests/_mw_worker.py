"""One process of a multi-worker scenario for tests/test_keras_compat.py.

Usage: python _mw_worker.py SCENARIO OUT_JSON [LOGICAL_CPUS]
TF_CONFIG comes from the environment (set by the test). Writes a JSON result
(final weights, replica count, error messages) so the test asserts in its own
process without importing TensorFlow.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GLOBAL_BATCH = 32
EPOCHS = 3
SAMPLES = 256
_ORIGINAL_REDUCE = None
_ORIGINAL_AUTOCONVERT = None


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(SAMPLES, 1))).astype("float32")
    return x, y


def _dataset():
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices(_data()).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    # Every worker reads the full file; DATA sharding splits each global batch.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


def _model(steps_per_execution: int = 1):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        metrics=["mae"],
        steps_per_execution=steps_per_execution,
    )
    return model


def _fit(strategy, steps_per_execution: int = 1) -> dict:
    if strategy is None:
        model = _model()
    else:
        with strategy.scope():
            model = _model(steps_per_execution)
    history = model.fit(_dataset(), epochs=EPOCHS, verbose=0)
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "loss": [float(v) for v in history.history["loss"]],
    }


def _fit_error(strategy, steps_per_execution: int = 1) -> str | None:
    try:
        _fit(strategy, steps_per_execution)
    except Exception as e:  # the upstream bug, whatever its type
        msg = f"{type(e).__name__}: {e}"
        # Keep the head and the tail: the middle may dump a whole data batch.
        return msg if len(msg) <= 600 else f"{msg[:300]} ... {msg[-300:]}"
    return None


def _error(fn) -> str | None:
    from keras_sync.errors import KerasSyncError

    try:
        fn()
    except KerasSyncError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _configure_cpus(n: int) -> None:
    import tensorflow as tf

    if n > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * n
        )


def main() -> int:
    scenario, out = sys.argv[1], sys.argv[2]
    cpus = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    result: dict = {"scenario": scenario}
    _configure_cpus(cpus)

    from keras.src.backend.tensorflow import trainer

    from keras_sync.errors import KerasSyncError
    from keras_sync.strategy import multi_worker as _multi_worker
    from keras_sync.upstream import keras_fixes as _keras_compat

    global _ORIGINAL_REDUCE, _ORIGINAL_AUTOCONVERT
    _ORIGINAL_REDUCE = trainer.reduce_per_replica
    _ORIGINAL_AUTOCONVERT = trainer.TensorFlowTrainer._autoconvert_optionals

    start = time.monotonic()
    try:
        if scenario == "reference":
            result.update(_fit(None))
            # Then, TensorFlow initialised by that fit, the multi-worker strategy is built too late
            # (one process less than a scenario of its own: the reference fit is what initialised it).
            late = os.environ.get("KS_LATE_TF_CONFIG")
            if late:
                os.environ["TF_CONFIG"] = late
                result["late_error"] = _error(
                    lambda: _multi_worker.build_multi_worker_strategy(connect_timeout_s=5)
                )
        elif scenario == "single":
            # No TF_CONFIG: one worker over this process's logical CPUs.
            result["bad_args"] = [
                _error(lambda: _multi_worker.build_multi_worker_strategy(local_devices=["banana"])),
            ]
            strategy = _multi_worker.build_multi_worker_strategy(
                local_devices=[f"CPU:{i}" for i in range(cpus)]
            )
            result["num_replicas"] = strategy.num_replicas_in_sync
            spec = strategy.cluster_resolver.cluster_spec()  # empty without TF_CONFIG: one worker
            result["num_workers"] = sum(spec.num_tasks(job) for job in spec.jobs) or 1
            result.update(_fit(strategy))
        elif scenario == "load":
            # The public path: YAML-shaped dict -> keras_sync.load -> Sync.fit on arrays.
            import keras_sync

            sync = keras_sync.load(
                {
                    "strategy": {"kind": "multi_worker_mirrored", "connect_timeout_s": 60},
                    "batch": {"global": GLOBAL_BATCH},
                    "mlflow": {"enabled": False},
                }
            )
            result["num_replicas"] = sync.num_replicas
            with sync.scope():
                model = _model()
            history = sync.fit(model, *_data(), epochs=EPOCHS, shuffle=False, verbose=0)
            result["weights"] = [w.tolist() for w in model.get_weights()]
            result["loss"] = [float(v) for v in history.history["loss"]]
        elif scenario == "timeout":
            start = time.monotonic()  # the clock starts at the constructor
            try:
                _multi_worker.build_multi_worker_strategy(connect_timeout_s=10)
                result["error"] = None
            except KerasSyncError as e:
                result["error_type"] = type(e).__name__
                result["error"] = str(e)
        elif scenario in ("unfixed_then_fixed", "fixed"):
            devices = [f"CPU:{i}" for i in range(cpus)] if cpus > 1 else None
            strategy = _multi_worker.build_multi_worker_strategy(
                local_devices=devices, connect_timeout_s=60
            )
            result["num_replicas"] = strategy.num_replicas_in_sync
            if scenario == "unfixed_then_fixed":
                result["unfixed_error"] = _fit_error(strategy)
            from keras_sync.upstream.patching import patched

            # The fixes as sync.fit applies them: for the length of the fits below only.
            patches = _keras_compat.multi_worker_patches()
            with patched(patches):
                result["patched"] = trainer.reduce_per_replica is patches[0][2]
                with patched(_keras_compat.multi_worker_patches()):  # nested: the first stays
                    result["patched_again"] = trainer.reduce_per_replica is patches[0][2]
                if scenario == "unfixed_then_fixed":
                    # Only the symbolic-build fix: shows the second upstream failure is real too.
                    trainer.reduce_per_replica = _ORIGINAL_REDUCE
                    result["build_fix_only_error"] = _fit_error(strategy)
                    trainer.reduce_per_replica = patches[0][2]
                result.update(_fit(strategy))
                # steps_per_execution > 1 (keras-team/keras#19246): fix 3 traces the step inline.
                with strategy.scope():
                    model = _model(steps_per_execution=2)
                _keras_compat.check_steps_per_execution(
                    model, strategy
                )  # accepts it: the fix is on
                autoconvert = trainer.TensorFlowTrainer._autoconvert_optionals
                result["spe_fixed"] = autoconvert is not _ORIGINAL_AUTOCONVERT
                spe = _fit(strategy, steps_per_execution=2)
                result["spe_weights"], result["spe_loss"] = spe["weights"], spe["loss"]
                if scenario == "unfixed_then_fixed":
                    # The upstream failure without fix 3 (a canary: this passes once Keras fixes
                    # it). Last: a failed step leaves the workers' collectives behind.
                    trainer.TensorFlowTrainer._autoconvert_optionals = _ORIGINAL_AUTOCONVERT
                    result["spe_upstream_error"] = _fit_error(strategy, steps_per_execution=2)
                    trainer.TensorFlowTrainer._autoconvert_optionals = autoconvert
            result["restored"] = trainer.reduce_per_replica is _ORIGINAL_REDUCE
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
    except BaseException:
        result["crash"] = traceback.format_exc()
    result["elapsed_s"] = time.monotonic() - start
    result["finished_at"] = time.time()
    with open(out, "w") as f:
        json.dump(result, f)
    return 0 if "crash" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
