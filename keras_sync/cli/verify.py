"""``keras-sync verify``: check that a distributed run trains exactly as one device would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from keras_sync.cli._base import SCRIPT_CONTEXT, UserError
from keras_sync.config import VERIFY_RECORD_ENV, VERIFY_REPLAY_ENV, VERIFY_STEPS_ENV


@click.command("verify", context_settings=SCRIPT_CONTEXT)
@click.option(
    "--steps", type=click.IntRange(min=1), default=20, help="Optimizer steps to train and compare."
)
@click.option(
    "--workers",
    "-n",
    type=click.IntRange(min=2),
    help="Run the distributed half as N local workers, started as `keras-sync launch -n N` starts them "
    "(default: one process, as the config says).",
)
@click.option("--config", type=click.Path(), help="keras-sync YAML file (sets $KERAS_SYNC_CONFIG).")
@click.option(
    "--compare",
    "recording",
    type=click.Path(),
    metavar="FOLDER",
    help="Do not run the distributed half: compare FOLDER, recorded under your own launcher with "
    "KERAS_SYNC_VERIFY_RECORD=FOLDER, with the one-device reference run here.",
)
@click.option(
    "--keep",
    type=click.Path(),
    metavar="FOLDER",
    help="Keep both recordings, the runs' output and the picture in FOLDER (default: a temporary folder).",
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
    end each layer's weights, to a tolerance that follows float32 rounding (wider under mixed
    precision). It prints where the runs part, then `verify: same as one device (...)` or
    `verify: different from one device: <cause> (...)`. Exit 0 same, 1 different, 2 usage error.
    With MLflow on, the comparison goes to an MLflow run of its own (tag keras_sync.verify).

    \b
    On a cluster, record under your own launcher, then compare on one node:
      KERAS_SYNC_VERIFY_RECORD=/shared/rec  (and KERAS_SYNC_VERIFY_STEPS=20)  your usual launch
      keras-sync verify --compare /shared/rec train.py [ARGS...]
    """
    from keras_sync.cli import verify_report as report
    from keras_sync.measures.verify_compare import verdict

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
    if config:
        env["KERAS_SYNC_CONFIG"] = config
    subject_dir, reference_dir = Path(recording or folder / "distributed"), folder / "one_device"
    try:  # a KerasSyncError becomes a one-line error in the group; the folder goes either way
        if recording is None:
            launch = ["-m", "keras_sync.launch", "-n", str(workers)] if workers else []
            record = {VERIFY_RECORD_ENV: str(subject_dir), VERIFY_STEPS_ENV: str(steps)}
            _run("distributed run", [*launch, script, *args], {**env, **record})
        subject = report.load_recording(subject_dir, f"the distributed run ({subject_dir})")
        record = {
            VERIFY_RECORD_ENV: str(reference_dir),
            VERIFY_STEPS_ENV: str(len(subject["steps"])),
            VERIFY_REPLAY_ENV: str(subject_dir.resolve()),
        }
        _run("one-device reference", [script, *args], {**env, **record})
        reference = report.load_recording(reference_dir, "the one-device reference")
        layers = report.layer_differences(subject_dir, reference_dir)
        result = verdict(
            subject["steps"], reference["steps"], layers, subject["facts"], subject["replicas"]
        )
        click.echo("\n".join(report.table(result, subject, reference)))
        if subject["mlflow"].get("enabled"):
            run_id = report.log_run(folder, result, subject, reference)
            click.echo(f"MLflow: the comparison is run {run_id} (tag keras_sync.verify)")
        elif keep:
            report.save(folder, result, subject, reference)
        click.echo(result.last_line)
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    sys.exit(0 if result.same else 1)


def _run(what: str, args: list[str], env: dict[str, str]) -> None:
    """Run one half into a fresh recording, its output beside it (``<recording>.log``)."""
    record = Path(env[VERIFY_RECORD_ENV])
    shutil.rmtree(record, ignore_errors=True)
    click.echo(f"verify: {what}: {' '.join(args)}", err=True)
    log = record.with_suffix(".log")
    with log.open("w") as out:
        code = subprocess.call(
            [sys.executable, *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise UserError(f"verify: the {what} failed (exit {code}); its last lines:\n{tail}")
