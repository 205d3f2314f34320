"""keras-sync: make a Keras 3 training script distributed with a YAML file and three lines.

Importing this package loads no TensorFlow, Keras or MLflow; they load on first use.
"""

from __future__ import annotations

from keras_sync.errors import (
    ClusterError,
    ConfigError,
    ConnectTimeoutError,
    KerasSyncError,
    ScalingError,
    StrategyError,
    TrackingError,
    UsageError,
)

__version__ = "0.1.0"

__all__ = [
    "ClusterError",
    "ConfigError",
    "ConnectTimeoutError",
    "KerasSyncError",
    "ScalingError",
    "StrategyError",
    "TrackingError",
    "UsageError",
    "__version__",
]
