"""`ModelLogging`: the trained model in MLflow's Keras flavour, logged by the chief at the end of `fit`."""

from __future__ import annotations

import json
import logging
import tempfile
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import keras

from keras_sync.measures import reduce as _reduce
from keras_sync.tracking import autolog as _autolog
from keras_sync.upstream.mlflow_internals import autologging

log = logging.getLogger("keras_sync")


class ModelLogging(keras.callbacks.Callback):
    """At the end of every `fit`, log the model as the run's LoggedModel ``model`` (Keras flavour).

    Loadable as autolog's is (``mlflow.pyfunc.load_model(f"runs:/{run_id}/model")``), with a
    signature and pinned requirements; staged beside the spool, so an outage delays it without
    losing it. The worker given a writer saves; nothing while ``mlflow.keras.autolog()`` logs models.

    Args:
        writer: a started `keras_sync.tracking.MlflowWriter`; None on the other workers.
        name: the LoggedModel's name (and the path in ``runs:/<run id>/<name>``).
        flush_timeout_s: longest wait at the end of `fit` for the model to reach MLflow.
    """

    def __init__(self, writer: Any = None, *, name: str = "model", flush_timeout_s: float = 60.0):
        super().__init__()
        _reduce.check_writer(writer, "log_artifact_file")
        self.writer, self.name, self.flush_timeout_s = writer, name, float(flush_timeout_s)

    def on_train_end(self, logs: dict | None = None) -> None:
        # Autolog on logs the model at the end of each fit (its default).
        if self.writer is None or (
            _autolog.keras_autolog_active()
            and autologging().get_autologging_config("keras", "log_models", True)
        ):
            return
        optimizer = self.model.optimizer
        step = int(optimizer.iterations.numpy()) if optimizer is not None else 0
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
            save_keras_model(self.model, Path(tmp) / self.name)
            self.writer.log_artifact_file(Path(tmp) / self.name, as_model=self.name, step=step)
        self.writer.flush(timeout_s=self.flush_timeout_s)  # the writer warns of what is left


def save_keras_model(model: Any, path: Path) -> None:
    """``mlflow.keras.save_model`` with a signature and pinned requirements; a model compiled with
    keras-sync's `GradualWarmup` is saved without its compile state (it would need keras_sync)."""
    import mlflow.keras
    from mlflow.keras.utils import get_model_signature

    if model.compiled and uses_keras_sync_objects(model.get_compile_config()):
        try:  # not keras.models.clone_model: it compiles the copy like the original
            copy = type(model).from_config(model.get_config())
            copy.set_weights(model.get_weights())
            model = copy
        except Exception as exc:
            log.warning(
                "keras-sync: the logged model keeps its optimizer, which uses keras-sync's "
                "GradualWarmup: loading it needs `import keras_sync` (cloning failed: %s).",
                exc,
            )
    try:
        signature = get_model_signature(model)
    except Exception:
        signature = None
    # Pinned here: MLflow's default infers them in a child process that imports TensorFlow.
    requirements = [f"keras=={keras.__version__}"]
    for dist in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu"):
        try:
            requirements.append(f"{dist}=={metadata.version(dist)}")
            break
        except metadata.PackageNotFoundError:
            continue
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "saving without a signature" when shapes are unknown
        mlflow.keras.save_model(
            model, str(path), signature=signature, pip_requirements=requirements
        )


def uses_keras_sync_objects(config: Any) -> bool:
    """True when a Keras config names a class from keras_sync (e.g. ``keras_sync>GradualWarmup``).

    >>> uses_keras_sync_objects({"optimizer": {"config": {"lr": {"module": "keras_sync.training"}}}})
    True
    >>> uses_keras_sync_objects({"optimizer": {"module": "keras.optimizers"}}), uses_keras_sync_objects(None)
    (False, False)
    """
    text = json.dumps(config, default=str)
    return '"module": "keras_sync"' in text or '"module": "keras_sync.' in text
