"""The environment as a block to paste into a bug report (``keras-sync env``).

Versions come from package metadata (no import); only the device list imports TensorFlow.
TF_CONFIG addresses and MLflow credentials are redacted: a report is posted in public.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from keras_sync import __version__
from keras_sync.config import CONFIG_ENV

# (label, distributions that provide it): the first one installed wins.
_PACKAGES = (
    ("Keras", ("keras",)),
    ("MLflow", ("mlflow", "mlflow-skinny")),
    ("NumPy", ("numpy",)),
    ("PyYAML", ("pyyaml",)),
    ("click", ("click",)),
)
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def _version(dists: tuple[str, ...]) -> str:
    for dist in dists:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return version if dist == dists[0] else f"{version} ({dist})"
    return "not installed"


def _devices() -> str:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's start-up chatter out of the report
    try:
        from keras_sync.upstream.tf_import import import_tensorflow

        import_tensorflow()
        import tensorflow as tf

        physical = tf.config.list_physical_devices()
    except Exception as exc:  # a broken TF install is exactly what a bug report must show
        return f"unavailable ({type(exc).__name__}: {exc})"
    return ", ".join(d.name.replace("/physical_device:", "") for d in physical) or "none"


def _redact_address(address: str) -> str:
    host, _, port = address.rpartition(":")
    return address if host in _LOCAL_HOSTS else f"<host>:{port}"


def _cluster(environ: Mapping[str, str]) -> str:
    from keras_sync.cluster import parse_tf_config

    raw = environ.get("TF_CONFIG")
    if not raw:
        return "unset"
    try:
        info = parse_tf_config(raw, env=environ)
    except Exception as exc:  # report it, do not fail: the bad TF_CONFIG may be the bug
        return f"invalid ({exc})"
    role = "chief" if info.is_chief else "not chief"
    addresses = ", ".join(_redact_address(a) for a in info.worker_addresses)
    return (
        f"{info.num_workers} worker(s) [{addresses}], this task {info.task_type}:{info.task_id} "
        f"({role}), written by {info.flavor}"
    )


def collect(*, devices: bool = True, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The report's entries, label -> value, in print order."""
    from keras_sync.strategy import count_gpus_cheaply
    from keras_sync.tracking import redact_uri
    from keras_sync.upstream import stack

    env = os.environ if environ is None else environ
    report: dict[str, Any] = {
        "keras-sync": __version__,
        "Python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        "Platform": platform.platform(),
        "CPU cores": str(os.cpu_count()),
    }
    # Every distribution of the `tensorflow` package, not the first found: two overwrite each other.
    report["TensorFlow"] = stack.describe_tensorflow()
    report.update({label: _version(dists) for label, dists in _PACKAGES})
    backend, source = stack.keras_backend(env)
    report["Keras backend"] = backend if source == "default" else f"{backend} (from {source})"
    report["GPUs (driver)"] = str(count_gpus_cheaply())
    report["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "unset")
    if devices:
        report["TensorFlow devices"] = _devices()
    report["TF_CONFIG"] = _cluster(env)
    report["MLFLOW_TRACKING_URI"] = redact_uri(env.get("MLFLOW_TRACKING_URI")) or "unset"
    report[CONFIG_ENV] = env.get(CONFIG_ENV, "unset")
    return report


def format_report(report: Mapping[str, str]) -> str:
    """A Markdown list, ready to paste under "Environment" in an issue."""
    lines = ["Copy-and-paste the text below into your bug report.", ""]
    lines += [f"- {label}: {value}" for label, value in report.items()]
    return "\n".join(lines)
