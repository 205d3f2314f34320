"""Artifact files and models that travel through the MLflow spool: copied into ``<spool>.files/``
and named by a `FILE` or `MODEL` record; the courier uploads them in order with the metrics and
removes each copy once MLflow has it, so an artifact outlives an outage or a kill.
"""

from __future__ import annotations

import contextlib
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
    return p.with_name(p.name + ".files")


def stage(spool_path: str | os.PathLike[str], local_path: str | os.PathLike[str]) -> Path:
    """Copy a file (kept under its own name) or a directory into the staging area; return the copy."""
    src = Path(local_path)
    slot = staging_dir(spool_path) / uuid.uuid4().hex[:16]
    slot.mkdir(parents=True)
    if src.is_dir():
        shutil.copytree(src, slot / "dir")
        return slot / "dir"
    return Path(shutil.copy2(src, slot / src.name))


def deliver(client: Any, run_id: str, rec: dict[str, Any], call: Callable[..., Any]) -> None:
    """Upload one staged record through ``call(fn, *args)``, then remove its copy (if there)."""
    src = Path(rec["src"])
    if not src.exists():
        return
    if rec["k"] == MODEL:
        _deliver_model(client, run_id, src, rec, call)
    elif src.is_dir():
        call(client.log_artifacts, run_id, str(src), rec.get("dir"))
    else:
        call(client.log_artifact, run_id, str(src), rec.get("dir"))
    shutil.rmtree(src.parent, ignore_errors=True)
    with contextlib.suppress(OSError):  # the staging directory, once it is empty
        src.parent.parent.rmdir()


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
        output = LoggedModelOutput(model_id, step=int(rec.get("step", 0)))
        call(client.log_outputs, run_id, [output])
    logged = call(client.get_logged_model, model_id)
    # save_model ran before MLflow knew the model; record its identity as Model.log does.
    mlmodel = Model.load(str(src / "MLmodel"))
    mlmodel.run_id, mlmodel.model_id, mlmodel.model_uuid = run_id, model_id, model_id
    mlmodel.artifact_path = logged.artifact_location
    mlmodel.save(str(src / "MLmodel"))
    call(client.log_model_artifacts, model_id, str(src))
    call(client.finalize_logged_model, model_id, LoggedModelStatus.READY)
