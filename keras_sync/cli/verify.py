from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from keras_sync.cli._base import SCRIPT_CONTEXT, UserError
from keras_sync.config import VERIFY_RECORD_ENV, VERIFY_REPLAY_ENV, VERIFY_STEPS_ENV
from keras_sync.measures.verify_compare import QUANTITIES, Verdict, verdict

ROWS = 5  # how many parting steps and layers the table shows
Run = dict[str, Any]  # a recording's record.json


@click.command("verify", context_settings=SCRIPT_CONTEXT)
@click.option(
    "--steps", type=click.IntRange(min=1), default=20, help="Optimizer steps to train and compare."
)
@click.option(
    "--workers",
    "-n",
    type=click.IntRange(min=2),
    help="Run the distributed half as N local workers, as `keras-sync launch -n N` does "
    "(default: one process, as the config says).",
)
@click.option("--config", type=click.Path(), help="keras-sync YAML file (sets $KERAS_SYNC_CONFIG).")
@click.option(
    "--compare",
    "recording",
    type=click.Path(),
    metavar="FOLDER",
    help="Compare FOLDER, recorded under your own launcher with KERAS_SYNC_VERIFY_RECORD=FOLDER, "
    "with the one-device reference run here (no distributed run).",
)
@click.option(
    "--keep",
    type=click.Path(),
    metavar="FOLDER",
    help="Keep both recordings, the runs' output and verify.json in FOLDER (default: a temporary one).",
)
@click.argument("script", type=click.Path())
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(
    steps: int,
    workers: int | None,
    config: str | None,
    recording: str | None,
    keep: str | None,
    script: str,
    args: tuple[str, ...],
) -> None:
    """Check that distributed training equals one device: run SCRIPT [ARGS...] for a few steps both ways and compare.

    \b
    1. As configured (N replicas, or -n N local workers), recording the first --steps optimizer steps.
    2. As the reference: one device, the same global batch, initial weights and batches (where no
       layer depends on the batch, as N accumulated micro-batches: one replica's memory).

    Per step it compares the loss, the update's norm, the learning rate and the examples, and at the
    end each layer's weights, to a tolerance that follows the float rounding. It prints where the
    runs part and `verify: same as one device (...)` or `verify: different from one device: <cause>`.
    Exit 0 same, 1 different, 2 usage error. With MLflow on, the comparison is logged to a run of its
    own (tag keras_sync.verify).

    \b
    On a cluster, record under your own launcher, then compare on one node:
      KERAS_SYNC_VERIFY_RECORD=/shared/rec  (and KERAS_SYNC_VERIFY_STEPS=20)  your usual launch
      keras-sync verify --compare /shared/rec train.py [ARGS...]
    """
    if not Path(script).is_file():
        raise UserError(
            f"verify: no such script: {script}. Expected the training script to check (a Python file)."
        )
    if recording is not None and workers is not None:
        raise UserError(
            "verify: --compare FOLDER takes the recording as it is; -n/--workers applies only to a run "
            "verify starts. Remove one of them."
        )
    folder = Path(keep or tempfile.mkdtemp(prefix="keras-sync-verify-"))
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in (VERIFY_REPLAY_ENV, "TF_CONFIG")}
    env.update({"KERAS_SYNC_CONFIG": config} if config else {})
    subject_dir, reference_dir = Path(recording or folder / "distributed"), folder / "one_device"
    try:
        if recording is None:
            launch = ["-m", "keras_sync.launch", "-n", str(workers)] if workers else []
            _run("distributed run", [*launch, script, *args], env, subject_dir, steps)
        subject = _load(subject_dir, f"the distributed run ({subject_dir})")
        replay = {**env, VERIFY_REPLAY_ENV: str(subject_dir.resolve())}
        _run("one-device reference", [script, *args], replay, reference_dir, len(subject["steps"]))
        reference = _load(reference_dir, "the one-device reference")
        layers = _layer_differences(subject_dir, reference_dir)
        facts, replicas = subject["facts"], subject["replicas"]
        result = verdict(subject["steps"], reference["steps"], layers, facts, replicas)
        lines = _table(result, subject, reference)
        click.echo("\n".join(lines))
        comparison = {**dataclasses.asdict(result), "table": lines, "last_line": result.last_line}
        (folder / "verify.json").write_text(json.dumps(comparison, indent=1))
        if subject["mlflow"].get("enabled"):
            run_id = _log_run(folder / "verify.json", result, subject, reference)
            click.echo(f"MLflow: the comparison is run {run_id} (tag keras_sync.verify)")
        click.echo(result.last_line)
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    sys.exit(0 if result.same else 1)


def _run(what: str, args: list[str], env: dict[str, str], record: Path, steps: int) -> None:
    """Run one half for ``steps`` steps into a fresh recording, its output in ``<record>.log``."""
    shutil.rmtree(record, ignore_errors=True)
    click.echo(f"verify: {what}: {' '.join(args)}", err=True)
    env = {**env, VERIFY_RECORD_ENV: str(record), VERIFY_STEPS_ENV: str(steps)}
    log = record.with_suffix(".log")
    with log.open("w") as out:
        code = subprocess.call(
            [sys.executable, *args], env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL
        )
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise UserError(f"verify: the {what} failed (exit {code}); its last lines:\n{tail}")


def _load(folder: Path, what: str) -> Run:
    from keras_sync.training.verify_record import RECORD_FILE

    path = folder / RECORD_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        why = f"{path}: {getattr(exc, 'strerror', None) or exc}"
        expected = "Expected a script that calls sync.fit under $KERAS_SYNC_VERIFY_RECORD."
        raise UserError(f"verify: {what} wrote no recording ({why}). {expected}") from None
    if not record.get("steps"):
        expected = "Expected sync.fit to train at least one."
        raise UserError(f"verify: {what} recorded no optimizer step ({path}). {expected}")
    return record


def _layer_differences(subject: Path, reference: Path) -> dict[str, tuple[float, float]]:
    """Each layer's largest |final weight difference| and largest |weight| (by layer path)."""
    import numpy as np

    from keras_sync.training.verify_record import FINAL_FILE

    out: dict[str, tuple[float, float]] = {}
    with np.load(subject / FINAL_FILE) as a, np.load(reference / FINAL_FILE) as b:
        for key in sorted(set(a.files) & set(b.files)):
            x, y = a[key].astype(np.float64), b[key].astype(np.float64)
            if x.shape == y.shape:
                layer = key.split(":", 1)[1].rpartition("/")[0] or key
                diff, big = out.get(layer, (0.0, 0.0))
                diff = max(diff, float(np.abs(x - y).max(initial=0.0)))
                out[layer] = (diff, max(big, float(np.abs(x).max(initial=0.0))))
    return out


def _table(result: Verdict, subject: Run, reference: Run) -> list[str]:
    """How each run trained, the first steps where they part, the layers that differ most."""
    from keras_sync.training.verify_record import whole_batch_reasons

    facts, workers, batch = subject["facts"], subject["workers"], subject["global_batch"]
    micro = reference["facts"].get("accumulation", 1) // max(1, facts.get("accumulation", 1))
    how = f"{micro} micro-batches of {reference['global_batch']} accumulated (one replica's memory)"
    if micro <= 1:
        reasons = "; ".join(whole_batch_reasons(facts, subject["steps"], batch))
        how = f"the full global batch of {batch}" + (f" ({reasons})" if reasons else "")
    on = f" on {workers} workers" if workers > 1 else ""
    run = f"{subject['replicas']} replicas{on} ({subject['kind']}), global batch {batch}"
    lines = [f"distributed: {run}; reference: one device, {how}"]
    if subject.get("peak_rss_mb") and reference.get("peak_rss_mb"):
        per = "the chief's process" if workers > 1 else "one process"
        mine, one = subject["peak_rss_mb"], reference["peak_rss_mb"]
        lines.append(f"peak memory: distributed {mine:.0f} MB ({per}), one device {one:.0f} MB")
    source = subject.get("input")
    left = f"nothing left that verify knows of (input: {source or 'unknown'})"
    if source in ("Python generator", "keras.utils.PyDataset"):
        left = f"not deterministic: a {source.rpartition('.')[2]}'s own randomness, if any"
    precision = facts.get("precision", "float32")
    lines += [
        f"determinism: seeds (Python, NumPy, Keras), initial weights and keras-sync's data order fixed; {left}",
        f"tolerance: {result.tolerance:.1e} relative ({precision} rounding over {result.steps} steps)",
    ]
    parts = result.partings
    if not parts:
        lines.append(
            f"every step alike: loss, update norm, learning rate, examples ({result.steps} steps)"
        )
    else:
        lines.append(f"{'step':>5}  {'quantity':<9} {'distributed':>13} {'one device':>13}")
        lines += [
            f"{p.step:>5}  {p.quantity:<9} {p.subject:>13.6g} {p.reference:>13.6g}"
            for p in parts[:ROWS]
        ]
        lines += [f"       ... {len(parts) - ROWS} more"] if len(parts) > ROWS else []
    lines.append(f"{'layer':<28} {'max |weight diff|':>18}")
    return lines + [f"{name[:28]:<28} {diff:>18.3g}" for name, diff in result.layers[:ROWS]]


def _log_run(comparison: Path, result: Verdict, subject: Run, reference: Run) -> str:
    """Log the comparison to an MLflow run of its own (tag ``keras_sync.verify``); its id."""
    import mlflow

    from keras_sync.tracking import resolve_tracking_uri
    from keras_sync.tracking.sqlite_store import ensure_sqlite_store

    uri, _ = resolve_tracking_uri(subject["mlflow"].get("tracking_uri"))
    ensure_sqlite_store(uri)
    mlflow.set_tracking_uri(uri)
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # not its "Creating a new experiment"
    mlflow.set_experiment(subject["mlflow"]["experiment"])
    tags = {
        "keras_sync.verify": "same" if result.same else "different",
        "keras_sync.verify.cause": (result.cause or "")[:5000],
        "keras_sync.verify.line": result.last_line[:5000],
    }
    name = f"verify {subject['kind']} x{subject['replicas']}"
    with mlflow.start_run(run_name=name, tags=tags) as run:
        mlflow.log_params({key: subject[key] for key in ("replicas", "kind", "global_batch")})
        mlflow.log_params({"steps": result.steps, "tolerance": f"{result.tolerance:.3g}"})
        for i, pair in enumerate(zip(subject["steps"], reference["steps"])):
            halves = zip(("distributed", "one_device"), pair)
            metrics = {f"verify/{h}/{q}": float(s[q]) for h, s in halves for q in QUANTITIES}
            mlflow.log_metrics(metrics, step=i)
        mlflow.log_artifact(str(comparison))
    return str(run.info.run_id)
