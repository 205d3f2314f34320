"""keras-sync: make a Keras 3 training script distributed with a YAML file and three lines
(`keras_sync.load`, `Sync.scope`, `Sync.fit`). Importing it loads no TensorFlow, Keras or MLflow."""

from __future__ import annotations

import importlib
from typing import Any

from keras_sync.config import Config, load_config
from keras_sync.errors import (
    ClusterError,
    CompatibilityError,
    ConfigError,
    ConnectTimeoutError,
    KerasSyncError,
    PeerLostError,
    ScalingError,
    StrategyError,
    TrackingError,
    UsageError,
)
from keras_sync.session import Sync, load
from keras_sync.training.scaling import (
    global_batch_size,
    per_replica_batch_size,
    scale_learning_rate,
    warmup_learning_rate,
)

__version__ = "0.1.0"

# Public names whose modules import Keras/TensorFlow: loaded on first attribute access.
_LAZY = {
    "GradualWarmup": "keras_sync.training.schedules",
    "AllReduceProbe": "keras_sync.callbacks.allreduce_probe",
    "BackupAndRestore": "keras_sync.callbacks.backup",
    "FitParams": "keras_sync.callbacks.fit_params",
    "ModelLogging": "keras_sync.callbacks.model_logging",
    "RunParams": "keras_sync.callbacks.run_params",
    "SyncReport": "keras_sync.callbacks.sync_report",
    "SyncMetrics": "keras_sync.callbacks.sync_metrics",
    "SystemMetrics": "keras_sync.callbacks.system_metrics",
    "WeightDivergence": "keras_sync.callbacks.weight_divergence",
    "RunContext": "keras_sync.training.context",
    "SharedState": "keras_sync.training.context",
}

__all__ = [
    *_LAZY,
    "ClusterError",
    "CompatibilityError",
    "Config",
    "ConfigError",
    "ConnectTimeoutError",
    "KerasSyncError",
    "PeerLostError",
    "ScalingError",
    "StrategyError",
    "Sync",
    "TrackingError",
    "UsageError",
    "__version__",
    "global_batch_size",
    "load",
    "load_config",
    "per_replica_batch_size",
    "scale_learning_rate",
    "warmup_learning_rate",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_sync' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
