from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import click

from keras_sync import __version__
from keras_sync.config import CONFIG_ENV


@click.command("env")
@click.option("--no-devices", is_flag=True, help="Skip the device list (it imports TensorFlow).")
def command(no_devices: bool) -> None:
    """Print versions, devices and the TF_CONFIG summary (redacted) for a bug report."""
    from keras_sync.strategy import count_gpus_cheaply
    from keras_sync.tracking import redact_uri
    from keras_sync.upstream import stack

    env = os.environ
    backend, source = stack.keras_backend(env)
    report = {
        "keras-sync": __version__,
        "Python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        "Platform": platform.platform(),
        "CPU cores": str(os.cpu_count()),
        "TensorFlow": stack.describe_tensorflow(),
        **{
            name: _version(name.lower()) for name in ("Keras", "MLflow", "NumPy", "PyYAML", "click")
        },
        "Keras backend": backend if source == "default" else f"{backend} (from {source})",
        "GPUs (driver)": str(count_gpus_cheaply()),
        "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "unset"),
        "TensorFlow devices": None if no_devices else _devices(),
        "TF_CONFIG": _cluster(env["TF_CONFIG"]) if env.get("TF_CONFIG") else "unset",
        "MLFLOW_TRACKING_URI": redact_uri(env.get("MLFLOW_TRACKING_URI")) or "unset",
        CONFIG_ENV: env.get(CONFIG_ENV, "unset"),
    }
    click.echo("Copy-and-paste the text below into your bug report.\n")
    click.echo("\n".join(f"- {key}: {value}" for key, value in report.items() if value is not None))


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> str:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's start-up chatter out of the report
    try:
        import tensorflow as tf

        physical = tf.config.list_physical_devices()
    except Exception as exc:  # a broken TF install is exactly what a bug report must show
        return f"unavailable ({type(exc).__name__}: {exc})"
    return ", ".join(d.name.replace("/physical_device:", "") for d in physical) or "none"


def _cluster(tf_config: str) -> str:
    """TF_CONFIG in words, every address but a local one redacted."""
    from keras_sync.cluster import parse_tf_config

    try:
        info = parse_tf_config(tf_config, env=os.environ)
    except Exception as exc:  # report it, do not fail: the bad TF_CONFIG may be the bug
        return f"invalid ({exc})"
    hosts = [a.rpartition(":") for a in info.worker_addresses]
    local = ("127.0.0.1", "localhost", "[::1]")
    addresses = ", ".join(f"{h if h in local else '<host>'}:{port}" for h, _, port in hosts)
    return (
        f"{info.num_workers} worker(s) [{addresses}], this task {info.task_type}:{info.task_id} "
        f"({'chief' if info.is_chief else 'not chief'}), written by {info.flavor}"
    )
