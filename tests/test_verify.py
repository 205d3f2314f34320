"""`keras-sync verify`: a distributed run against its one-device reference, through the real console script.

The slow tests run the user's script (tests/_verify_train.py, one case each) through `keras-sync
verify` on 2 simulated CPU replicas (`mirrored`) and as 2 local workers (`-n 2`), two at a time.
"""

from __future__ import annotations

import functools
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _cli_run
import pytest
from _cli_run import KERAS_SYNC, cli_env

SCRIPT = Path(__file__).with_name("_verify_train.py")
STEPS = "6"
_env = functools.partial(cli_env, TF_CPP_MIN_LOG_LEVEL="2")
run = functools.partial(_cli_run.run, timeout=1200, TF_CPP_MIN_LOG_LEVEL="2")


# -- usage errors (no TensorFlow) ---------------------------------------------------------------


def test_a_missing_script_is_a_usage_error(tmp_path: Path) -> None:
    result = run("verify", "nope.py", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert (
        result.stderr
        == "verify: no such script: nope.py. Expected the training script to check (a Python file).\n"
    )


def test_compare_with_workers_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    result = run("verify", "--compare", "rec", "-n", "2", "train.py", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        "verify: --compare FOLDER takes the recording as it is; -n/--workers applies only to a "
        "run verify starts. Remove one of them.\n"
    )


def test_compare_of_a_folder_without_a_recording_names_it(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "rec").mkdir()
    result = run("verify", "--compare", "rec", "train.py", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "verify: the distributed run (rec) wrote no recording (rec/record.json: "
        "No such file or directory). Expected a script that calls sync.fit"
    )
    assert "Traceback" not in result.stderr


def test_compare_of_a_recording_without_steps_names_it(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / "record.json").write_text('{"steps": []}')
    result = run("verify", "--compare", "rec", "train.py", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (
        2,
        "verify: the distributed run (rec) recorded no optimizer step (rec/record.json). "
        "Expected sync.fit to train at least one.\n",
    )


def test_a_script_that_fails_is_a_usage_error_with_its_last_lines(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("raise SystemExit('no data here')\n")
    result = run("verify", "train.py", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines()[1:] == [
        "verify: the distributed run failed (exit 1); its last lines:",
        "no data here",
    ]


def test_a_bad_steps_variable_names_it() -> None:
    from keras_sync.config import load_config
    from keras_sync.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"\$KERAS_SYNC_VERIFY_STEPS: received 'x', expected a number of optimizer "
        r"steps >= 1",
    ):
        load_config(
            {}, environ={"KERAS_SYNC_VERIFY_RECORD": "/tmp/r", "KERAS_SYNC_VERIFY_STEPS": "x"}
        )


def test_a_reference_run_takes_the_recordings_one_device_settings(tmp_path: Path) -> None:
    from keras_sync.config import load_config

    (tmp_path / "reference.json").write_text(
        json.dumps(
            {
                "strategy.kind": "default",
                "strategy.simulated_cpu_replicas": 0,
                "batch.per_replica": None,
                "batch.global": 4,
                "runtime.gradient_accumulation_steps": 2,
            }
        )
    )
    cfg = load_config(
        {
            "strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2},
            "batch": {"per_replica": 4},
        },
        environ={"KERAS_SYNC_VERIFY_RECORD": "/tmp/r", "KERAS_SYNC_VERIFY_REPLAY": str(tmp_path)},
    )
    assert (cfg.strategy.kind, cfg.batch.global_, cfg.runtime.gradient_accumulation_steps) == (
        "default",
        4,
        2,
    )
    assert (cfg.verify.steps, cfg.verify.mlflow, cfg.mlflow.enabled) == (20, True, False)
    assert cfg.source_of("strategy.kind") == "env"


# -- the comparison's maths (keras_sync/measures/verify_compare.py) ----------------------------------

RUN = [{"examples": 8, "lr": 0.1, "loss": 1.0, "update": 0.5}] * 3


def test_equal_runs_are_the_same_and_a_weight_difference_alone_has_no_known_cause() -> None:
    from keras_sync.measures.verify_compare import verdict

    v = verdict(RUN, RUN, {"dense": (1e-7, 0.9)}, {}, 2)
    assert (v.same, v.cause, f"{v.tolerance:.1e}") == (True, None, "3.1e-05")
    assert (
        verdict(RUN, RUN, {"dense": (0.2, 0.9)}, {}, 2).cause
        == "no known cause fits; what differed: the final weights"
    )


def test_a_loss_that_differs_is_a_parting_at_its_step() -> None:
    from keras_sync.measures.verify_compare import Parting, verdict

    other = RUN[:1] + [{**RUN[0], "loss": 1.2}] * 2
    assert verdict(RUN, other, {}, {}, 2).partings[0] == Parting(1, "loss", 1.0, 1.2)


def test_likely_cause_names_examples_first_then_the_gradient_scale() -> None:
    from keras_sync.measures.verify_compare import Parting, likely_cause

    assert likely_cause([Parting(0, "examples", 16, 8)], [], [], {}, 2).startswith(
        "examples per step differ: "
    )
    s, r = [{"update": 2.0}], [{"update": 1.0}]
    assert likely_cause([Parting(0, "update", 2.0, 1.0)], s, r, {"custom_train_step": True}, 2)[
        :42
    ] == ("the gradient is 2 times too large (the cus")
    assert likely_cause([Parting(0, "update", 1.0, 4.0)], r, [{"update": 4.0}], {}, 4).startswith(
        "the gradient is 4 times too small "
    )


# -- real runs: 2 simulated CPU replicas and 2 local workers --------------------------------------

CONFIGS = {
    "mirrored": {"strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2}},
    "workers": {"strategy": {"kind": "multi_worker_mirrored"}},
}
#: (name, config, extra keys, script args, -n 2?)
CASES = [
    (f"{where}-{case}", where, extra, (case,), where == "workers")
    for where in CONFIGS
    for case, extra in (
        ("dense", {}),
        ("uneven", {}),
        ("dataset", {}),
        ("custom_sum", {"runtime": {"train_step_gradients": "sum"}}),
        ("batchnorm", {}),
        ("syncbn", {"runtime": {"sync_batch_norm": True}}),
        ("dropout", {}),
        ("add_loss", {}),
        ("masked", {}),
    )
] + [
    ("mirrored-spe", "mirrored", {"runtime": {"steps_per_execution": 2}}, ("dense",), False),
    (
        "mirrored-spe-uneven",
        "mirrored",
        {"runtime": {"steps_per_execution": 3}},
        ("uneven",),
        False,
    ),
]


def _config(tmp: Path, name: str, where: str, extra: dict, mlflow: bool = False) -> Path:
    import yaml

    data = {
        **CONFIGS[where],
        "batch": {"per_replica": 4},
        "learning_rate": {"base": 0.05},
        "mlflow": {"enabled": mlflow},
        **extra,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """Every case through `keras-sync verify`, two at a time; the two-phase form; one with MLflow on."""
    tmp = tmp_path_factory.mktemp("verify")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"

    def verify(
        name: str, *args: str, where: str = "mirrored", extra=None, mlflow=False, steps=STEPS
    ):
        config = _config(tmp, name, where, extra or {}, mlflow=mlflow)
        return ["verify", "--steps", steps, "--config", str(config), *args]

    jobs = {}
    for name, where, extra, args, workers in CASES:
        args = ("batchnorm",) if args == ("syncbn",) else args
        n = ["-n", "2"] if workers else []
        cmd = verify(
            name, "--keep", str(tmp / name), *n, str(SCRIPT), *args, where=where, extra=extra
        )
        jobs[name] = (cmd, {})
    jobs["mobilenet"] = (verify("mobilenet", str(SCRIPT), "mobilenet", "frozen_bn", steps="2"), {})
    jobs["mlflow"] = (
        verify("mlflow", str(SCRIPT), "dense", mlflow=True),
        {"MLFLOW_TRACKING_URI": uri},
    )

    def two_phase():
        config = str(_config(tmp, "two_phase", "workers", {}))
        rec = tmp / "recorded"
        launched = subprocess.run(
            [KERAS_SYNC, "launch", "-n", "2", "--config", config, str(SCRIPT), "dense"],
            env=_env(KERAS_SYNC_VERIFY_RECORD=str(rec), KERAS_SYNC_VERIFY_STEPS=STEPS),
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert launched.returncode == 0, launched.stdout + launched.stderr
        return run(
            "verify", "--compare", str(rec), "--config", config, str(SCRIPT), "dense", cwd=tmp
        )

    with ThreadPoolExecutor(2) as pool:
        futures = {
            name: pool.submit(run, *cmd, cwd=tmp, **env) for name, (cmd, env) in jobs.items()
        }
        futures["two_phase"] = pool.submit(two_phase)
        results = {name: f.result() for name, f in futures.items()}
    return tmp, uri, results


def _last(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr


WHERE = ["mirrored", "workers"]


@pytest.mark.slow
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("case", ["dense", "dataset"])
def test_a_plain_model_is_the_same_as_one_device(verified, where: str, case: str) -> None:
    result = verified[2][f"{where}-{case}"]
    assert _last(result).startswith("verify: same as one device ("), result.stdout + result.stderr
    assert result.returncode == 0
    assert (
        "every step alike" in result.stdout and "2 micro-batches of 4 accumulated" in result.stdout
    )
    assert (verified[0] / f"{where}-{case}" / "verify.json").is_file()  # --keep without MLflow
    assert (
        "determinism: seeds (Python, NumPy, Keras), initial weights and keras-sync's data order fixed; nothing "
        "left that verify knows of (input: " in result.stdout
    )


@pytest.mark.slow
@pytest.mark.parametrize("where", WHERE)
def test_an_uneven_last_batch_is_compared_with_the_whole_batch_on_one_device(
    verified, where: str
) -> None:
    # Accumulated micro-batches of 4 would not line up with the replicas' split of 5 examples (3 + 2).
    result = verified[2][f"{where}-uneven"]
    assert _last(result).startswith("verify: same as one device ("), result.stdout + result.stderr
    assert result.returncode == 0
    assert "the full global batch of 8 (a batch of 5 examples, not 8)" in result.stdout


@pytest.mark.slow
def test_several_steps_per_execution_are_compared_with_the_whole_batch_on_one_device(
    verified,
) -> None:
    # Accumulated micro-batches would put half the examples in each recorded execution.
    result = verified[2]["mirrored-spe"]
    assert _last(result).startswith("verify: same as one device ("), result.stdout + result.stderr
    assert result.returncode == 0
    assert "the full global batch of 8 (2 steps per execution)" in result.stdout


@pytest.mark.slow
def test_an_uneven_batch_inside_an_execution_weighs_each_step_by_its_own_examples(verified) -> None:
    # One execution trains 8, 8 and 5 examples; the replicas split the 5 as 3 + 2, not 11 + 10.
    result = verified[2]["mirrored-spe-uneven"]
    assert _last(result).startswith("verify: same as one device ("), result.stdout + result.stderr
    assert result.returncode == 0
    assert "(3 steps per execution; a batch of 5 examples, not 8)" in result.stdout
    assert "every step alike: loss, update norm" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("where", WHERE)
def test_a_masked_loss_is_the_mean_over_the_tokens_of_the_whole_global_batch(
    verified, where: str
) -> None:
    # Each replica's loss is a mean over its own unpadded tokens; one device's, over the global
    # batch's. Accumulated micro-batches would share the replicas' error, so the reference is whole.
    result = verified[2][f"{where}-masked"]
    assert _last(result).startswith("verify: same as one device ("), result.stdout + result.stderr
    assert result.returncode == 0
    assert "the full global batch of 8 (a masked loss depends on the batch)" in result.stdout
    assert "every step alike: loss, update norm" in result.stdout


#: case -> how the last line names its cause.
CAUSES = {
    "custom_sum": "the gradient is 2 times too large (the custom train_step's loss is not divided",
    "dropout": "random ops draw different numbers on each replica (dropout: ",
    "add_loss": "an add_loss term that sums over the batch",
}


@pytest.mark.slow
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("case", CAUSES)
def test_a_difference_is_named_by_its_cause(verified, where: str, case: str) -> None:
    result = verified[2][f"{where}-{case}"]
    assert result.returncode == 1, result.stdout + result.stderr
    assert _last(result).startswith(f"verify: different from one device: {CAUSES[case]}")


@pytest.mark.slow
@pytest.mark.parametrize("where", WHERE)
def test_batch_norm_per_replica_is_named_and_sync_batch_norm_is_the_same(
    verified, where: str
) -> None:
    result = verified[2][f"{where}-batchnorm"]
    assert result.returncode == 1, result.stdout + result.stderr
    assert _last(result).startswith("verify: different from one device: BatchNorm batch statistics")
    assert "the full global batch of 8 (BatchNorm depends on the batch)" in result.stdout
    synced = verified[2][f"{where}-syncbn"]
    assert _last(synced).startswith("verify: same as one device ("), synced.stdout + synced.stderr
    assert synced.returncode == 0


@pytest.mark.slow
def test_a_recording_made_under_launch_is_compared_on_one_node(verified) -> None:
    result = verified[2]["two_phase"]
    assert _last(result).startswith("verify: same as one device ("), result.stdout + result.stderr
    assert result.returncode == 0
    assert "2 replicas on 2 workers (multi_worker_mirrored)" in result.stdout


@pytest.mark.slow
def test_the_verify_run_in_mlflow_holds_the_comparison(verified) -> None:
    from mlflow.tracking import MlflowClient

    _, uri, results = verified
    assert _last(results["mlflow"]).startswith("verify: same as one device ("), results[
        "mlflow"
    ].stderr
    client = MlflowClient(uri)
    [run] = client.search_runs(
        [client.get_experiment_by_name("keras-sync").experiment_id],
        "tags.keras_sync.verify = 'same'",
    )
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"verify.json"}
    assert len(client.get_metric_history(run.info.run_id, "verify/distributed/loss")) == int(STEPS)
    assert run.data.tags["keras_sync.verify.line"] == _last(results["mlflow"])


@pytest.mark.slow
def test_a_mobilenet_sized_reference_trains_one_replicas_micro_batches(verified) -> None:
    result = verified[2]["mobilenet"]
    assert _last(result).startswith("verify: same as one device ("), result.stdout + result.stderr
    assert (
        "reference: one device, 2 micro-batches of 4 accumulated (one replica's memory)"
        in result.stdout
    )
    assert "peak memory: distributed " in result.stdout
