"""What `keras-sync verify` prints and logs: the table, the last line, the MLflow run with its picture."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from keras_sync.errors import UsageError
from keras_sync.measures.verify_compare import Verdict

#: How many parting steps and layers the table shows.
ROWS = 5
#: A recording's ``record.json`` (`keras_sync.training.verify_record`).
Run = Mapping[str, Any]
Folder = str | os.PathLike[str]


def load_recording(folder: Folder, what: str) -> dict[str, Any]:
    """A recording's ``record.json``, or a one-line error naming the folder."""
    from keras_sync.training.verify_record import RECORD_FILE

    path = Path(folder) / RECORD_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"verify: {what} wrote no recording ({path}: {getattr(exc, 'strerror', None) or exc}). "
            "Expected a script that calls sync.fit (keras-sync's three lines) under "
            "$KERAS_SYNC_VERIFY_RECORD."
        ) from None
    if not record.get("steps"):
        raise UsageError(
            f"verify: {what} recorded no optimizer step ({path}); expected sync.fit to train at least one"
        )
    return record


def layer_differences(subject_dir: Folder, reference_dir: Folder) -> dict[str, tuple[float, float]]:
    """Each layer's largest |final weight difference| and largest |weight| (weights grouped by their layer path)."""
    import numpy as np

    from keras_sync.training.verify_record import FINAL_FILE

    out: dict[str, tuple[float, float]] = {}
    with (
        np.load(Path(subject_dir) / FINAL_FILE) as a,
        np.load(Path(reference_dir) / FINAL_FILE) as b,
    ):
        for key in sorted(set(a.files) & set(b.files)):
            x, y = a[key].astype(np.float64), b[key].astype(np.float64)
            if x.shape != y.shape:
                continue
            layer = key.split(":", 1)[1].rpartition("/")[0] or key
            diff = float(np.max(np.abs(x - y))) if x.size else 0.0
            big = float(np.max(np.abs(x))) if x.size else 0.0
            old = out.get(layer, (0.0, 0.0))
            out[layer] = (max(old[0], diff), max(old[1], big))
    return out


def determinism(source: str | None) -> str:
    """The one line on what verify made deterministic, and what it could not (by the training input's kind).

    >>> determinism("Python generator")[-62:]
    "not deterministic: a Python generator's own randomness, if any"
    """
    fixed = "determinism: seeds (Python, NumPy, Keras), initial weights and keras-sync's data order fixed"
    if source in ("Python generator", "keras.utils.PyDataset"):
        kind = "Python generator" if source == "Python generator" else "PyDataset"
        return f"{fixed}; not deterministic: a {kind}'s own randomness, if any"
    return f"{fixed}; nothing left that verify knows of (input: {source or 'unknown'})"


def table(verdict: Verdict, subject: Run, reference: Run) -> list[str]:
    """The short table: the first steps where the runs part, the layers with the largest difference."""
    from keras_sync.training.verify_record import depends_on_batch

    accumulation = subject["facts"].get("accumulation", 1)
    micro = reference["facts"].get("accumulation", 1) // max(1, accumulation)
    if micro > 1:
        how = f"{micro} micro-batches of {reference['global_batch']} accumulated (one replica's memory)"
    else:
        how = f"the full global batch of {subject['global_batch']}"
        if depends := depends_on_batch(subject["facts"]):
            how += f" ({' and '.join(depends)} depend(s) on the batch)"
    on = f" on {subject['workers']} workers" if subject.get("workers", 1) > 1 else ""
    run = f"{subject['replicas']} replicas{on} ({subject['kind']}), global batch {subject['global_batch']}"
    lines = [f"distributed: {run}; reference: one device, {how}"]
    if subject.get("peak_rss_mb") and reference.get("peak_rss_mb"):
        per = "the chief's process" if subject.get("workers", 1) > 1 else "one process"
        lines.append(
            f"peak memory: distributed {subject['peak_rss_mb']:.0f} MB ({per}), one device "
            f"{reference['peak_rss_mb']:.0f} MB"
        )
    lines.append(determinism(subject.get("input")))
    lines.append(
        f"tolerance: {verdict.tolerance:.1e} relative ({subject['facts'].get('precision', 'float32')} "
        f"rounding over {verdict.steps} steps)"
    )
    if verdict.partings:
        lines.append(f"{'step':>5}  {'quantity':<9} {'distributed':>13} {'one device':>13}")
        for p in verdict.partings[:ROWS]:
            lines.append(f"{p.step:>5}  {p.quantity:<9} {p.subject:>13.6g} {p.reference:>13.6g}")
        if len(verdict.partings) > ROWS:
            lines.append(f"       ... {len(verdict.partings) - ROWS} more")
    else:
        alike = "every step alike: loss, update norm, learning rate, examples"
        lines.append(f"{alike} ({verdict.steps} steps)")
    lines.append(f"{'layer':<28} {'max |weight diff|':>18}")
    for name, diff in verdict.layers[:ROWS]:
        lines.append(f"{name[:28]:<28} {diff:>18.3g}")
    return lines


def last_line(verdict: Verdict) -> str:
    """``verify: same as one device (...)`` or ``verify: different from one device: <cause> (...)``."""
    largest = verdict.layers[0][1] if verdict.layers else 0.0
    figures = f"{verdict.steps} steps, largest weight difference {largest:.2g}, tolerance {verdict.tolerance:.1e}"
    if verdict.same:
        return f"verify: same as one device ({figures})"
    return f"verify: different from one device: {verdict.cause} ({figures})"


def draw(path: Folder, verdict: Verdict, subject: Run, reference: Run) -> None:
    """The picture: both loss curves, and each layer's largest weight difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run, label, style in (
        (subject, f"distributed ({subject['replicas']} replicas)", "-"),
        (reference, "one device", "--"),
    ):
        left.plot([s["loss"] for s in run["steps"]], style, label=label)
    left.set(title="loss per optimizer step", xlabel="step", ylabel="loss")
    left.legend()
    names = [n for n, _ in verdict.layers][:20]
    diffs = [max(d, 1e-12) for _, d in verdict.layers][:20]
    right.barh(names[::-1], diffs[::-1])
    right.axvline(verdict.tolerance, color="red", linestyle=":", label="tolerance")
    right.set(title="largest |weight difference| per layer", xscale="log")
    right.legend()
    title = f"different from one device: {(verdict.cause or '').split(':')[0].split(' (')[0]}"
    fig.suptitle(f"verify: {'same as one device' if verdict.same else title}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def save(folder: Folder, verdict: Verdict, subject: Run, reference: Run) -> tuple[str, str]:
    """Write ``verify.png`` (the picture) and ``verify.json`` (the comparison) into ``folder``; their names."""
    draw(Path(folder) / "verify.png", verdict, subject, reference)
    comparison = {
        "same": verdict.same,
        "cause": verdict.cause,
        "tolerance": verdict.tolerance,
        "partings": [p.__dict__ for p in verdict.partings],
        "layers": verdict.layers,
        "table": table(verdict, subject, reference),
        "last_line": last_line(verdict),
    }
    (Path(folder) / "verify.json").write_text(json.dumps(comparison, indent=1))
    return "verify.png", "verify.json"


def log_run(folder: Folder, verdict: Verdict, subject: Run, reference: Run) -> str:
    """Log the comparison to an MLflow run of its own (tag ``keras_sync.verify``); return its id."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    from keras_sync.tracking import resolve_tracking_uri
    from keras_sync.tracking.sqlite_store import ensure_sqlite_store

    settings = subject["mlflow"]
    uri, _ = resolve_tracking_uri(settings.get("tracking_uri"))
    ensure_sqlite_store(uri)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(settings["experiment"])
    experiment_id = (
        experiment.experiment_id if experiment else client.create_experiment(settings["experiment"])
    )
    run = client.create_run(
        experiment_id,
        run_name=f"verify {subject['kind']} x{subject['replicas']}",
        tags={
            "keras_sync.verify": "same" if verdict.same else "different",
            "keras_sync.verify.cause": (verdict.cause or "")[:5000],
        },
    )
    rid = run.info.run_id
    metrics = []
    for name, run_ in (("distributed", subject), ("one_device", reference)):
        for i, s in enumerate(run_["steps"][: verdict.steps]):
            for q in ("loss", "update", "lr", "examples"):
                metrics.append(Metric(f"verify/{name}/{q}", float(s[q]), 0, i))
    params = [
        Param("replicas", str(subject["replicas"])),
        Param("kind", subject["kind"]),
        Param("global_batch", str(subject["global_batch"])),
        Param("steps", str(verdict.steps)),
        Param("tolerance", f"{verdict.tolerance:.3g}"),
    ]
    client.log_batch(
        rid,
        metrics=metrics[:1000],
        params=params,
        tags=[RunTag("keras_sync.verify.line", last_line(verdict)[:5000])],
    )
    for start in range(1000, len(metrics), 1000):
        client.log_batch(rid, metrics=metrics[start : start + 1000])
    for name in save(folder, verdict, subject, reference):
        client.log_artifact(rid, str(Path(folder) / name))
    client.set_terminated(rid, "FINISHED")
    return rid
