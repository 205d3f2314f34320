"""Artifact files and models that travel through the MLflow spool.

The training process copies (or saves) them into a staging directory next to the spool,
``<name>.files/``, and queues a record naming the staged path; the courier process (or
``keras-sync sync-spool``) uploads them in order with the metrics and removes each staged copy
once MLflow has it. So an artifact outlives an outage or a killed process exactly as a metric
point does, and the caller may change or delete its own file at once.

Records (`keras_sync.tracking.records`): `FILE` ``{"src": path, "dir": artifact_dir}`` (a file or a
directory of files) and `MODEL` ``{"src": dir, "name": name, "step": step}`` (a directory written by an MLflow
flavour's ``save_model``; it becomes a LoggedModel of the run, as ``mlflow.keras.log_model``
would make it). MLflow is imported by the courier only.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keras_sync.tracking.records import MODEL

#: Written beside a staged model once MLflow gave it an id, so a retried delivery reuses it.
_MODEL_ID_SUFFIX = ".model_id"


def staging_dir(spool_path: str | os.PathLike[str]) -> Path:
    """The directory holding the staged artifacts of the spool ``spool_path``."""
    p = Path(spool_path)
    return p.with_name(p.name.replace(".spool.jsonl", "") + ".files")


def new_slot(spool_path: str | os.PathLike[str]) -> Path:
    """A fresh, empty directory in the staging area (a model can be saved straight into it)."""
    slot = staging_dir(spool_path) / uuid.uuid4().hex[:16]
    slot.mkdir(parents=True)
    return slot


def stage(spool_path: str | os.PathLike[str], local_path: str | os.PathLike[str]) -> Path:
    """Copy a file (kept under its own name) or a directory into the staging area; return the copy."""
    src = Path(local_path)
    slot = new_slot(spool_path)
    if src.is_dir():
        dst = slot / "dir"
        shutil.copytree(src, dst)
        return dst
    dst = slot / src.name
    shutil.copy2(src, dst)
    return dst


def remove_staging_if_empty(spool_path: str | os.PathLike[str]) -> None:
    """Remove the staging directory once every staged artifact has been delivered."""
    try:
        staging_dir(spool_path).rmdir()
    except OSError:  # absent, or still holding undelivered artifacts
        pass


def deliver(client: Any, run_id: str, rec: dict[str, Any], call: Callable[..., Any]) -> None:
    """Upload one staged record to the run, then remove its staged copy.

    ``call(fn, *args)`` wraps every MLflow call (the courier's fast-fail settings). A staged
    path that no longer exists was delivered by an earlier attempt that stopped before it could
    record so: nothing is sent again.
    """
    src = Path(rec["src"])
    if not src.exists():
        return
    if rec["k"] == MODEL:
        _deliver_model(client, run_id, src, rec, call)
    elif src.is_dir():
        call(client.log_artifacts, run_id, str(src), rec.get("dir"))
    else:
        call(client.log_artifact, run_id, str(src), rec.get("dir"))
    slot = src.parent
    shutil.rmtree(slot, ignore_errors=True)
    try:
        slot.parent.rmdir()  # the staging directory, once it is empty
    except OSError:
        pass


def _deliver_model(
    client: Any, run_id: str, src: Path, rec: dict[str, Any], call: Callable[..., Any]
) -> None:
    """The steps of ``mlflow.models.Model.log``, for a model saved earlier in another process."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    id_file = src.parent / (src.name + _MODEL_ID_SUFFIX)
    model_id = id_file.read_text().strip() if id_file.exists() else None
    if model_id is None:
        experiment_id = call(client.get_run, run_id).info.experiment_id
        logged = call(
            client.create_logged_model,
            experiment_id,
            name=rec.get("name", "model"),
            source_run_id=run_id,
            tags={"mlflow.source.type": "LOCAL"},
        )
        model_id = logged.model_id
        id_file.write_text(model_id)
        call(
            client.log_outputs, run_id, [LoggedModelOutput(model_id, step=int(rec.get("step", 0)))]
        )
    logged = call(client.get_logged_model, model_id)
    # save_model ran before MLflow knew the model; record its identity as Model.log does.
    mlmodel = Model.load(str(src / "MLmodel"))
    mlmodel.run_id, mlmodel.model_id, mlmodel.model_uuid = run_id, model_id, model_id
    mlmodel.artifact_path = logged.artifact_location
    mlmodel.save(str(src / "MLmodel"))
    call(client.log_model_artifacts, model_id, str(src))
    call(client.finalize_logged_model, model_id, LoggedModelStatus.READY)
