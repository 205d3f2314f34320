"""What `keras-sync verify` reads, prints and logs: the recordings, the table, the MLflow run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from keras_sync.errors import UsageError
from keras_sync.measures.verify_compare import Verdict

#: How many parting steps and layers the table shows.
ROWS = 5
#: A recording's ``record.json`` (`keras_sync.training.verify_record`).
Run = dict[str, Any]


def load_recording(folder: Path, what: str) -> Run:
    """A recording's ``record.json``, or a one-line error naming the folder."""
    from keras_sync.training.verify_record import RECORD_FILE

    path = folder / RECORD_FILE
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
            f"verify: {what} recorded no optimizer step ({path}); expected sync.fit to train at "
            "least one"
        )
    return record


def layer_differences(subject_dir: Path, reference_dir: Path) -> dict[str, tuple[float, float]]:
    """Each layer's largest |final weight difference| and largest |weight| (by layer path)."""
    import numpy as np

    from keras_sync.training.verify_record import FINAL_FILE

    out: dict[str, tuple[float, float]] = {}
    with np.load(subject_dir / FINAL_FILE) as a, np.load(reference_dir / FINAL_FILE) as b:
        for key in sorted(set(a.files) & set(b.files)):
            x, y = a[key].astype(np.float64), b[key].astype(np.float64)
            if x.shape != y.shape:
                continue
            layer = key.split(":", 1)[1].rpartition("/")[0] or key
            diff, big = np.abs(x - y).max(initial=0.0), np.abs(x).max(initial=0.0)
            old = out.get(layer, (0.0, 0.0))
            out[layer] = (max(old[0], float(diff)), max(old[1], float(big)))
    return out


def table(verdict: Verdict, subject: Run, reference: Run) -> list[str]:
    """The short table: how each run trained, the first steps where they part, the layers that differ most."""
    from keras_sync.training.verify_record import depends_on_batch

    facts = subject["facts"]
    micro = reference["facts"].get("accumulation", 1) // max(1, facts.get("accumulation", 1))
    if micro > 1:
        how = f"{micro} micro-batches of {reference['global_batch']} accumulated (one replica's memory)"
    else:
        how = f"the full global batch of {subject['global_batch']}"
        if depends := depends_on_batch(facts):
            how += f" ({' and '.join(depends)} depend(s) on the batch)"
    workers = subject.get("workers", 1)
    on = f" on {workers} workers" if workers > 1 else ""
    run = f"{subject['replicas']} replicas{on} ({subject['kind']}), global batch {subject['global_batch']}"
    lines = [f"distributed: {run}; reference: one device, {how}"]
    if subject.get("peak_rss_mb") and reference.get("peak_rss_mb"):
        per = "the chief's process" if workers > 1 else "one process"
        lines.append(
            f"peak memory: distributed {subject['peak_rss_mb']:.0f} MB ({per}), one device "
            f"{reference['peak_rss_mb']:.0f} MB"
        )
    source = subject.get("input")
    left = f"nothing left that verify knows of (input: {source or 'unknown'})"
    if source in ("Python generator", "keras.utils.PyDataset"):
        left = f"not deterministic: a {source.rpartition('.')[2]}'s own randomness, if any"
    lines.append(
        "determinism: seeds (Python, NumPy, Keras), initial weights and keras-sync's data order "
        f"fixed; {left}"
    )
    lines.append(
        f"tolerance: {verdict.tolerance:.1e} relative ({facts.get('precision', 'float32')} "
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
    lines += [f"{name[:28]:<28} {diff:>18.3g}" for name, diff in verdict.layers[:ROWS]]
    return lines


def save(folder: Path, verdict: Verdict, subject: Run, reference: Run) -> list[Path]:
    """Write ``verify.png`` (both loss curves, each layer's difference) and ``verify.json``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    distributed = f"distributed ({subject['replicas']} replicas)"
    left.plot([s["loss"] for s in subject["steps"]], "-", label=distributed)
    left.plot([s["loss"] for s in reference["steps"]], "--", label="one device")
    left.set(title="loss per optimizer step", xlabel="step", ylabel="loss")
    left.legend()
    layers = verdict.layers[:20][::-1]
    right.barh([n for n, _ in layers], [max(d, 1e-12) for _, d in layers])
    right.axvline(verdict.tolerance, color="red", linestyle=":", label="tolerance")
    right.set(title="largest |weight difference| per layer", xscale="log")
    right.legend()
    cause = (verdict.cause or "").split(":")[0].split(" (")[0]
    title = "same as one device" if verdict.same else f"different from one device: {cause}"
    fig.suptitle(f"verify: {title}")
    fig.tight_layout()
    fig.savefig(folder / "verify.png", dpi=90)
    plt.close(fig)
    comparison = {
        **dataclasses.asdict(verdict),
        "table": table(verdict, subject, reference),
        "last_line": verdict.last_line,
    }
    (folder / "verify.json").write_text(json.dumps(comparison, indent=1))
    return [folder / "verify.png", folder / "verify.json"]


def log_run(folder: Path, verdict: Verdict, subject: Run, reference: Run) -> str:
    """Log the comparison to an MLflow run of its own (tag ``keras_sync.verify``); its id."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from keras_sync.tracking import resolve_tracking_uri
    from keras_sync.tracking.sqlite_store import ensure_sqlite_store

    settings = subject["mlflow"]
    uri, _ = resolve_tracking_uri(settings.get("tracking_uri"))
    ensure_sqlite_store(uri)
    client = MlflowClient(uri)
    name = settings["experiment"]
    experiment = client.get_experiment_by_name(name)
    run = client.create_run(
        experiment.experiment_id if experiment else client.create_experiment(name),
        run_name=f"verify {subject['kind']} x{subject['replicas']}",
        tags={
            "keras_sync.verify": "same" if verdict.same else "different",
            "keras_sync.verify.cause": (verdict.cause or "")[:5000],
            "keras_sync.verify.line": verdict.last_line[:5000],
        },
    )
    rid = run.info.run_id
    params = {key: subject[key] for key in ("replicas", "kind", "global_batch")}
    params.update(steps=verdict.steps, tolerance=f"{verdict.tolerance:.3g}")
    metrics = [
        Metric(f"verify/{name}/{q}", float(s[q]), 0, i)
        for name, rec in (("distributed", subject), ("one_device", reference))
        for i, s in enumerate(rec["steps"][: verdict.steps])
        for q in ("loss", "update", "lr", "examples")
    ]
    client.log_batch(rid, params=[Param(k, str(v)) for k, v in params.items()])
    for start in range(0, len(metrics), 1000):  # MLflow's limit of metrics per batch
        client.log_batch(rid, metrics=metrics[start : start + 1000])
    for path in save(folder, verdict, subject, reference):
        client.log_artifact(rid, str(path))
    client.set_terminated(rid, "FINISHED")
    return rid
