"""Cluster sources: TF_CONFIG (Kubeflow TFJob, Ray Train, plain), Slurm, and the TF_CONFIG order check."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _ports import free_ports

from keras_sync.cluster import (
    SINGLE,
    SINGLE_PROCESS,
    ClusterInfo,
    Role,
    check_tf_config_order,
    cluster_from_env,
    expand_hostlist,
    expand_tasks_per_node,
    is_chief,
    parse_slurm_env,
    parse_tf_config,
    record_strategy_tf_config,
    role,
)
from keras_sync.errors import ClusterError
from keras_sync.launch import launch

ROOT = Path(__file__).resolve().parents[1]

# As the Kubeflow training-operator writes them (Go json.Marshal of TFConfig: cluster keys sorted;
# the evaluator is left out of the cluster; "environment": "cloud").
_TFJOB_CLUSTER = {
    "chief": ["mnist-chief-0.kubeflow.svc:2222"],
    "worker": ["mnist-worker-0.kubeflow.svc:2222", "mnist-worker-1.kubeflow.svc:2222"],
}


def tfjob(task_type: str, index: int) -> str:
    return json.dumps({"cluster": _TFJOB_CLUSTER, "task": {"type": task_type, "index": index}, "environment": "cloud"})


# As Ray Train's TensorflowConfig writes it: a worker list only, world rank as index.
RAY = json.dumps({"cluster": {"worker": ["10.0.0.5:40001", "10.0.0.6:40002"]}, "task": {"type": "worker", "index": 1}})
PLAIN_W0 = json.dumps({"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "task": {"type": "worker", "index": 0}})
RAY_ENV = {"RAY_RAYLET_PID": "4242", "RAY_JOB_ID": "01000000"}


def test_tfjob_chief_worker_evaluator() -> None:
    chief = parse_tf_config(tfjob("chief", 0), env={})
    assert chief == ClusterInfo(
        source="tf_config",
        task_type="chief",
        task_id=0,
        num_workers=3,
        is_chief=True,
        worker_addresses=[
            "mnist-chief-0.kubeflow.svc:2222",
            "mnist-worker-0.kubeflow.svc:2222",
            "mnist-worker-1.kubeflow.svc:2222",
        ],
        flavor="kubeflow",
    )
    worker0 = parse_tf_config(tfjob("worker", 0), env={})
    assert (worker0.task_type, worker0.task_id, worker0.is_chief, worker0.num_workers) == ("worker", 0, False, 3)
    evaluator = parse_tf_config(tfjob("evaluator", 0), env={})
    # TensorFlow's rule: the evaluator is outside the training cluster and a chief on its own.
    assert (evaluator.task_type, evaluator.is_chief, evaluator.num_workers) == ("evaluator", True, 3)


def test_ray_train_worker_list_is_ray() -> None:
    info = parse_tf_config(RAY, env=RAY_ENV)
    assert (info.flavor, info.task_id, info.is_chief) == ("ray", 1, False)
    rank0 = parse_tf_config(RAY.replace('"index": 1', '"index": 0'), env=RAY_ENV)
    assert rank0.is_chief


def test_same_worker_list_outside_ray_is_plain() -> None:
    info = parse_tf_config(PLAIN_W0, env={})
    assert (info.flavor, info.is_chief, info.num_workers) == ("plain", True, 2)


@pytest.mark.parametrize("raw", [None, "", "  ", "{}"])
def test_no_tf_config_is_a_single_process(raw: str | None) -> None:
    assert parse_tf_config(raw, env={}) == SINGLE_PROCESS


def test_index_given_as_string_is_accepted_like_tensorflow() -> None:
    raw = json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": "1"}})
    assert parse_tf_config(raw, env={}).task_id == 1


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            json.dumps({"sparseCluster": {"worker": {"1": "w1:2222"}, "ps": []}, "task": {"type": "worker", "index": 1}}),
            "`sparseCluster`.*not supported by MultiWorkerMirroredStrategy.*enableDynamicWorker: false",
        ),
        (
            json.dumps({"cluster": {"ps": ["p:1"], "worker": ["w:1"]}, "task": {"type": "worker", "index": 0}}),
            "`ps` tasks, which are not supported by MultiWorkerMirroredStrategy.*Fix: remove the PS replicas",
        ),
        ('{"cluster": {"worker": ["a:1",]}}', r"TF_CONFIG is not valid JSON \(Expecting value at line 1 column 31, char 30\)"),
        ('["a:1"]', "TF_CONFIG must be a JSON object"),
        (json.dumps({"cluster": {"worker": ["a:1"]}}), "TF_CONFIG has no `task`.*Received: task=None"),
        (
            json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}),
            r"task.index is out of range for `worker` \(2 task\(s\).*Expected an index from 0 to 1",
        ),
        (
            json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}),
            r"out of range for `chief` \(0 task",
        ),
        (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}), "task.index must be an integer >= 0. Received: task.index=None"),
        (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}}), "task.type is not a training role. Received: task.type='ps'"),
        (json.dumps({"cluster": {"master": ["a:1"]}, "task": {"type": "worker", "index": 0}}), "unknown job `master`"),
        (json.dumps({"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}}), "cluster.worker must be a list"),
        (
            json.dumps({"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}),
            "cluster.chief must have at most one task.*replicas: 1",
        ),
        (json.dumps({"cluster": {"evaluator": ["e:1"]}, "task": {"type": "evaluator", "index": 0}}), "no `chief` or `worker` tasks"),
        (json.dumps({"task": {"type": "worker", "index": 0}}), "TF_CONFIG has no `cluster`"),
    ],
)
def test_bad_tf_config_names_the_problem(raw: str, message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        parse_tf_config(raw, env={})


@pytest.mark.parametrize(
    ("cluster", "task", "expected"),
    [
        ({"chief": ["c"], "worker": ["w0", "w1"]}, ("chief", 0), True),
        ({"chief": ["c"], "worker": ["w0", "w1"]}, ("worker", 0), False),
        ({"worker": ["w0", "w1"]}, ("worker", 0), True),
        ({"worker": ["w0", "w1"]}, ("worker", 1), False),
        ({"worker": ["w0"]}, ("evaluator", 0), True),
    ],
)
def test_chief_rule(cluster: dict, task: tuple[str, int], expected: bool) -> None:
    assert is_chief(cluster, *task) is expected
    assert role(cluster, *task).is_chief is expected  # the one role function applies the same rule


@pytest.mark.parametrize(("cluster", "task", "expected"), [
    (None, (None, None), SINGLE),
    ({}, ("worker", 0), SINGLE),
    ({"worker": ["w0", "w1"]}, ("worker", 1), Role(False, "worker", 1, 2)),
    ({"chief": ["c"], "worker": ["w0", "w1"]}, ("chief", 0), Role(True, "chief", 0, 3)),
    ({"chief": ["c"], "worker": ["w0"], "evaluator": ["e"]}, ("evaluator", 0), Role(True, "evaluator", 0, 2)),
])
def test_role_says_chief_task_and_training_workers(cluster: dict | None, task: tuple, expected: Role) -> None:
    assert role(cluster, *task) == expected


def test_parsed_tf_config_and_role_agree() -> None:
    info = parse_tf_config(tfjob("worker", 1), env={})
    assert role(json.loads(tfjob("worker", 1))["cluster"], "worker", 1) == Role(
        info.is_chief, info.task_type, info.task_id, info.num_workers)


def _slurm_env(procid: int, port_base_hosts: str = "localhost", tasks: str = "2") -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "77",
        "SLURM_PROCID": str(procid),
        "SLURM_STEP_NUM_TASKS": tasks,
        "SLURM_STEP_NODELIST": port_base_hosts,
        "SLURM_STEP_TASKS_PER_NODE": tasks,
    }


def test_slurm_env_two_tasks_on_one_node() -> None:
    info = parse_slurm_env(_slurm_env(1), port_base=9000)
    assert info == ClusterInfo("slurm", "worker", 1, 2, False, ["localhost:9000", "localhost:9001"])


def test_slurm_hostlist_and_tasks_per_node_like_tensorflow() -> None:
    assert expand_hostlist("gpu[01-02,07],login") == ["gpu01", "gpu02", "gpu07", "login"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    env = {
        "SLURM_PROCID": "0",
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_STEP_NODELIST": "nb,na[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
    }
    assert parse_slurm_env(env).worker_addresses == ["na1:8888", "na2:8888", "nb:8888"]  # sorted, as TF does


def test_slurm_outside_a_step_says_use_srun() -> None:
    with pytest.raises(ClusterError, match=r"SLURM_STEP_NUM_TASKS.*are not set.*Received: SLURM_JOB_ID='77'.*srun python train.py"):
        parse_slurm_env({"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "x", "SLURM_STEP_TASKS_PER_NODE": "1"})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"SLURM_STEP_TASKS_PER_NODE": "two"}, "Slurm variables cannot be read"),
        ({"SLURM_STEP_NUM_TASKS": "3"}, "Slurm variables disagree"),
        ({"SLURM_PROCID": "2"}, "SLURM_PROCID is out of range"),
    ],
)
def test_bad_slurm_env(changes: dict[str, str], message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        parse_slurm_env({**_slurm_env(0), **changes})


def test_cluster_from_env_prefers_tf_config_then_slurm() -> None:
    assert cluster_from_env({"TF_CONFIG": PLAIN_W0, **_slurm_env(1)}).source == "tf_config"
    assert cluster_from_env(_slurm_env(1)).source == "slurm"
    assert cluster_from_env({**_slurm_env(0, tasks="1")}) == SINGLE_PROCESS
    assert cluster_from_env({}) == SINGLE_PROCESS


def test_order_check_catches_tf_config_changed_after_strategy() -> None:
    record_strategy_tf_config(PLAIN_W0)
    try:
        check_tf_config_order(PLAIN_W0)
        check_tf_config_order(json.dumps(json.loads(PLAIN_W0), indent=2))  # same cluster, other spelling
        with pytest.raises(ClusterError, match=r"TF_CONFIG changed after keras_sync built a strategy.*tensorflow#60706.*before `keras_sync.load\(\)`"):
            check_tf_config_order(PLAIN_W0.replace('"index": 0', '"index": 1'))
        with pytest.raises(ClusterError, match="TF_CONFIG changed"):
            check_tf_config_order(None, env={})
    finally:
        from keras_sync import cluster

        cluster._recorded.clear()


@pytest.mark.slow
def test_against_tensorflow_resolvers_and_a_real_strategy() -> None:
    """TF's own resolvers and `is_chief` agree with the pure parsers; a joined cluster is detected."""
    examples = [tfjob("chief", 0), tfjob("worker", 0), tfjob("worker", 1), tfjob("evaluator", 0), RAY, PLAIN_W0]
    port_base = free_ports(1)[0]
    request = {"tf_configs": examples, "slurm_env": _slurm_env(1), "port_base": port_base}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_launch_tf_cluster.py"), json.dumps(request)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for raw, tf_view in zip(examples, result["tf_config"]):
        ours = parse_tf_config(raw, env={})
        assert (ours.task_type, ours.task_id, ours.is_chief) == (tf_view["task_type"], tf_view["task_id"], tf_view["is_chief"])
        assert ours.worker_addresses == tf_view["cluster"].get("chief", []) + tf_view["cluster"]["worker"]

    slurm = result["slurm"]
    expected = parse_slurm_env(_slurm_env(1), port_base=port_base)
    assert slurm["cluster"] == {"worker": expected.worker_addresses}
    assert (slurm["task_type"], slurm["task_id"]) == ("worker", 1)
    assert slurm["num_accelerators"] == {}  # no phantom GPU on a CPU machine
    assert slurm["cuda_visible_devices"] is None

    order = result["order"]
    assert order["replicas"] == 1
    assert re.search("TF_CONFIG changed after keras_sync built a strategy", order["recorded"])
    assert re.search(r"TensorFlow in this process already joined the cluster .*127\.0\.0\.1.* as worker:0", order["tf_context"])


def _two_consecutive_free_ports() -> int:
    for _ in range(50):
        base = free_ports(1)[0]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise AssertionError("no two consecutive free ports")


@pytest.mark.slow
def test_two_slurm_tasks_all_reduce_with_the_slurm_resolver(capsys: pytest.CaptureFixture[str]) -> None:
    """Two processes with srun-like variables on 127.0.0.1 build a real MultiWorkerMirroredStrategy."""
    port_base = _two_consecutive_free_ports()
    code = launch(str(ROOT / "tests" / "_launch_tf_worker.py"), ["slurm", str(port_base)], workers=2, grace_period_s=1)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    results = [json.loads(line.partition(" ")[2]) for line in sorted(out.splitlines()) if '{"task_id"' in line]
    assert [(r["task_id"], r["sum"], r["replicas"], r["is_chief"], r["tf_is_chief"]) for r in results] == [
        (0, 3.0, 2, True, True),
        (1, 3.0, 2, False, False),
    ]
