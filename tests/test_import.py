"""`import keras_sync` must stay light: no TensorFlow, Keras or MLflow (TF alone costs ~4 s)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("tensorflow", "keras", "mlflow")


def loaded_after(code: str) -> list[str]:
    probe = (
        f"{code}\nimport sys\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return eval(out.stdout.strip().splitlines()[-1])


def test_import_keras_sync_loads_no_tensorflow_keras_mlflow():
    assert (
        loaded_after(
            "import keras_sync; keras_sync.load_config({}); keras_sync.scale_learning_rate("
            "0.1, global_batch_size=64, base_batch_size=32, rule='linear')"
        )
        == []
    )


def test_the_probe_can_fail():
    # The same probe sees TensorFlow when something does import it: the test above is not vacuous.
    assert loaded_after("import keras_sync; keras_sync.GradualWarmup") != []


def test_public_api_is_listed():
    import keras_sync

    for name in keras_sync.__all__:
        if name != "GradualWarmup":
            assert hasattr(keras_sync, name), name
    assert {"load", "Sync", "scale_learning_rate", "ConfigError", "KerasSyncError"} <= set(
        keras_sync.__all__
    )


PUBLIC_API = [
    "AllReduceProbe",
    "BackupAndRestore",
    "ClusterError",
    "CompatibilityError",
    "Config",
    "ConfigError",
    "ConnectTimeoutError",
    "FitParams",
    "GradualWarmup",
    "KerasSyncError",
    "ModelLogging",
    "PeerLostError",
    "RunContext",
    "RunParams",
    "ScalingError",
    "SharedState",
    "StrategyError",
    "Sync",
    "SyncMetrics",
    "SyncReport",
    "SystemMetrics",
    "TrackingError",
    "UsageError",
    "WeightDivergence",
    "__version__",
    "global_batch_size",
    "load",
    "load_config",
    "per_replica_batch_size",
    "scale_learning_rate",
    "warmup_learning_rate",
]


def test_public_api_is_pinned():
    # A change of the layout moves modules, never the public names: a new or removed name is a
    # decision of its own (README's API table, a version note), made here on purpose.
    import keras_sync

    assert sorted(keras_sync.__all__) == PUBLIC_API


def test_the_writer_protocol_keeps_its_documented_path():
    # README's API table names keras_sync.tracking.Writer and keras_sync.tracking.MlflowWriter.
    code = "from keras_sync.tracking import MlflowWriter, Writer; print(MlflowWriter.__module__)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "keras_sync.tracking"
