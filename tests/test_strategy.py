"""What `strategy.kind: auto` picks and why, and the devices each kind trains on: no TensorFlow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from keras_sync.cli.plan import make_plan
from keras_sync.config import load_config
from keras_sync.config.kinds import KINDS, STRATEGY_KINDS
from keras_sync.errors import ClusterError, UsageError
from keras_sync.strategy import BUILDERS, check_one_process, detect, device_layout

TWO_WORKERS = json.dumps(
    {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
)


def test_every_kind_but_auto_has_a_builder():
    assert set(BUILDERS) | {"auto"} == set(STRATEGY_KINDS)
    assert "auto" not in BUILDERS  # auto is resolved by detect() into one of the others


@pytest.mark.parametrize(
    "config, env, gpus, kind, reason",
    [
        ({}, {}, 0, "default", "auto: one worker, no GPU, no simulated replicas"),
        ({}, {}, 1, "default", "auto: one worker, one GPU, no simulated replicas"),
        ({}, {}, 4, "mirrored", "auto: 4 GPUs"),
        (
            {"strategy": {"simulated_cpu_replicas": 2}},
            {},
            0,
            "mirrored",
            "auto: strategy.simulated_cpu_replicas=2",
        ),
        (
            {},
            {"TF_CONFIG": TWO_WORKERS},
            0,
            "multi_worker_mirrored",
            "auto: TF_CONFIG (plain) names 2 workers",
        ),
        ({}, {"TPU_NAME": "t1"}, 8, "tpu", "auto: $TPU_NAME is set"),
        (
            {"strategy": {"kind": "mirrored"}},
            {"TF_CONFIG": TWO_WORKERS},
            0,
            "mirrored",
            "strategy.kind is 'mirrored' (dict)",
        ),
    ],
)
def test_auto_detection(config, env, gpus, kind, reason):
    d = detect(load_config(config, environ={}), env, gpus=gpus)
    assert (d.kind, d.reason) == (kind, reason)


def test_one_task_tf_config_is_not_multi_worker():
    one = json.dumps(
        {"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}
    )
    assert detect(load_config({}, environ={}), {"TF_CONFIG": one}, gpus=0).kind == "default"


def test_bad_tf_config_is_a_cluster_error():
    with pytest.raises(ClusterError, match="TF_CONFIG"):
        detect(load_config({}, environ={}), {"TF_CONFIG": "{not json"}, gpus=0)


@pytest.mark.parametrize(
    "kind, strategy, gpus, devices, source",
    [
        ("default", {}, 0, ("/cpu:0",), "tensorflow"),
        (
            "default",
            {"devices": ["/cpu:0", "/cpu:1"]},
            2,
            ("/gpu:0",),
            "tensorflow",
        ),  # get_strategy() takes no list
        ("one_device", {}, 4, ("/gpu:0",), "tensorflow"),
        ("one_device", {"simulated_cpu_replicas": 2}, 0, ("/cpu:0",), "simulated"),
        ("one_device", {"devices": ["/cpu:0"]}, 1, ("/cpu:0",), "strategy.devices"),
        ("mirrored", {}, 0, ("/cpu:0",), "tensorflow"),
        ("mirrored", {}, 2, ("/gpu:0", "/gpu:1"), "tensorflow"),
        ("mirrored", {"simulated_cpu_replicas": 3}, 2, ("/cpu:0", "/cpu:1", "/cpu:2"), "simulated"),
        ("mirrored", {"devices": ["/gpu:1"]}, 2, ("/gpu:1",), "strategy.devices"),
        ("multi_worker_mirrored", {}, 2, ("/gpu:0", "/gpu:1"), "tensorflow"),
        (
            "multi_worker_mirrored",
            {"simulated_cpu_replicas": 2},
            0,
            ("/cpu:0", "/cpu:1"),
            "simulated",
        ),
    ],
)
def test_device_layout_is_what_the_builders_use(kind, strategy, gpus, devices, source):
    layout = device_layout(
        kind, load_config({"strategy": strategy}, environ={}).strategy, gpus=gpus
    )
    assert (layout.devices, layout.source) == (devices, source)
    assert layout.explicit_devices == (None if source == "tensorflow" else list(devices))


def test_device_layout_has_no_answer_for_tpu():
    with pytest.raises(ValueError, match="kind='tpu'"):
        device_layout("tpu", load_config({}, environ={}).strategy, gpus=0)


@pytest.mark.parametrize(
    "strategy, devices, replicas",
    [
        (
            {"kind": "mirrored", "simulated_cpu_replicas": 2},
            ["/cpu:0 (logical)", "/cpu:1 (logical)"],
            2,
        ),
        ({"kind": "one_device", "devices": ["/cpu:1"]}, ["/cpu:1"], 1),
        ({"kind": "default"}, ["/cpu:0"], 1),
        ({"kind": "tpu", "tpu": {"name": "t1"}}, ["TPU t1"], 8),
    ],
)
def test_plan_shows_the_device_layout(strategy, devices, replicas, monkeypatch):
    monkeypatch.setenv(
        "CUDA_VISIBLE_DEVICES", ""
    )  # the plan counts GPUs itself: none, on any machine
    items = make_plan(load_config({"strategy": strategy}, environ={}), environ={}).to_dict()[
        "items"
    ]
    assert (items["devices"]["value"], items["replicas"]["value"]) == (devices, replicas)


def test_plan_shows_the_slurm_ports_and_where_they_come_from(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "node1",
        "SLURM_STEP_TASKS_PER_NODE": "2",
    }
    auto = {"kind": "multi_worker_mirrored", "cluster": "slurm"}
    items = make_plan(load_config({"strategy": auto}, environ={}), environ=env).to_dict()["items"]
    assert items["workers"]["value"] == 2
    assert items["strategy.slurm.port_base"] == {
        "value": 29712,
        "source": "derived",
        "note": "auto: from $SLURM_JOB_ID=77 and $SLURM_STEP_ID=0",
    }
    fixed = {**auto, "slurm": {"port_base": 9000}}
    items = make_plan(load_config({"strategy": fixed}, environ={}), environ=env).to_dict()["items"]
    assert items["strategy.slurm.port_base"]["value"] == 9000
    assert items["strategy.slurm.port_base"]["source"] != "derived"


@pytest.mark.parametrize("kind", STRATEGY_KINDS)
def test_a_one_process_kind_under_a_cluster_of_two_workers_is_refused_with_the_fix(kind):
    cfg = load_config({"strategy": {"kind": kind}}, environ={})
    if not KINDS[kind].one_process:
        check_one_process(
            cfg, {"TF_CONFIG": TWO_WORKERS}
        )  # auto picks multi_worker_mirrored; the others join
        return
    check_one_process(cfg, {})  # one process: nothing to refuse
    with pytest.raises(UsageError) as raised:
        check_one_process(cfg, {"TF_CONFIG": TWO_WORKERS})
    assert str(raised.value) == (
        f"TF_CONFIG (plain) names 2 workers, but strategy.kind is '{kind}' in a dict passed to keras_sync.load() "
        "(no file), a kind that runs in one process: each worker would train on its own. Fix: set strategy.kind: "
        "auto or multi_worker_mirrored, or start one process only."
    )


def test_load_refuses_mirrored_under_a_two_worker_tf_config_in_one_line_before_tensorflow(tmp_path):
    (tmp_path / "keras_sync.yaml").write_text("strategy:\n  kind: mirrored\n")
    code = (
        "import sys, keras_sync\n"
        "try:\n    keras_sync.load()\nfinally:\n    print('tensorflow' in sys.modules, file=sys.stderr)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KERAS_SYNC_CONFIG"}
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**env, "TF_CONFIG": TWO_WORKERS},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.splitlines() == [
        "False",
        (
            f"keras-sync: TF_CONFIG (plain) names 2 workers, but strategy.kind is 'mirrored' in "
            f"{(tmp_path / 'keras_sync.yaml').resolve()}, a kind that runs in one process: each worker would train "
            "on its own. Fix: set strategy.kind: auto or multi_worker_mirrored, or start one process only."
        ),
    ]
