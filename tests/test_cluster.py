"""Cluster sources: TF_CONFIG (Kubeflow TFJob, Ray Train, plain), Slurm, and the TF_CONFIG order check."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _ports import free_ports

from keras_sync.cluster import (
    CLUSTER_SOURCES,
    INDEX_VAR,
    SINGLE,
    SINGLE_PROCESS,
    ClusterInfo,
    Role,
    check_tf_config_order,
    expand_hostlist,
    expand_tasks_per_node,
    is_chief,
    parse_slurm_env,
    parse_tf_config,
    read_cluster,
    record_strategy_tf_config,
    role,
    slurm_port_base,
    training_tasks,
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
    return json.dumps(
        {
            "cluster": _TFJOB_CLUSTER,
            "task": {"type": task_type, "index": index},
            "environment": "cloud",
        }
    )


# As Ray Train's TensorflowConfig writes it: a worker list only, world rank as index.
RAY = json.dumps(
    {
        "cluster": {"worker": ["10.0.0.5:40001", "10.0.0.6:40002"]},
        "task": {"type": "worker", "index": 1},
    }
)
PLAIN_W0 = json.dumps(
    {
        "cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
        "task": {"type": "worker", "index": 0},
    }
)
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
    assert (worker0.task_type, worker0.task_id, worker0.is_chief, worker0.num_workers) == (
        "worker",
        0,
        False,
        3,
    )
    evaluator = parse_tf_config(tfjob("evaluator", 0), env={})
    # TensorFlow's rule: the evaluator is outside the training cluster and a chief on its own.
    assert (evaluator.task_type, evaluator.is_chief, evaluator.num_workers) == (
        "evaluator",
        True,
        3,
    )


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
    raw = json.dumps(
        {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": "1"}}
    )
    assert parse_tf_config(raw, env={}).task_id == 1


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            json.dumps(
                {
                    "sparseCluster": {"worker": {"1": "w1:2222"}, "ps": []},
                    "task": {"type": "worker", "index": 1},
                }
            ),
            "`sparseCluster`.*not supported by MultiWorkerMirroredStrategy.*enableDynamicWorker: false",
        ),
        (
            json.dumps(
                {
                    "cluster": {"ps": ["p:1"], "worker": ["w:1"]},
                    "task": {"type": "worker", "index": 0},
                }
            ),
            "`ps` tasks, which are not supported by MultiWorkerMirroredStrategy.*Fix: remove the PS replicas",
        ),
        (
            '{"cluster": {"worker": ["a:1",]}}',
            r"TF_CONFIG is not valid JSON \(Expecting value at line 1 column 31, char 30\)",
        ),
        ('["a:1"]', "TF_CONFIG must be a JSON object"),
        (
            json.dumps({"cluster": {"worker": ["a:1"]}}),
            "TF_CONFIG has no `task`.*Received: task=None",
        ),
        (
            json.dumps(
                {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}
            ),
            r"task.index is out of range for `worker` \(2 task\(s\).*Expected an index from 0 to 1",
        ),
        (
            json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}),
            r"out of range for `chief` \(0 task",
        ),
        (
            json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}),
            "task.index must be an integer >= 0. Received: task.index=None",
        ),
        (
            json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}}),
            "task.type is not a training role. Received: task.type='ps'",
        ),
        (
            json.dumps({"cluster": {"master": ["a:1"]}, "task": {"type": "worker", "index": 0}}),
            "unknown job `master`",
        ),
        (
            json.dumps({"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}}),
            "cluster.worker must be a list",
        ),
        (
            json.dumps(
                {"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}
            ),
            "cluster.chief must have at most one task.*replicas: 1",
        ),
        (
            json.dumps(
                {"cluster": {"evaluator": ["e:1"]}, "task": {"type": "evaluator", "index": 0}}
            ),
            "no `chief` or `worker` tasks",
        ),
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


@pytest.mark.parametrize(
    ("cluster", "task", "expected"),
    [
        (None, (None, None), SINGLE),
        ({}, ("worker", 0), SINGLE),
        ({"worker": ["w0", "w1"]}, ("worker", 1), Role(False, "worker", 1, 2)),
        ({"chief": ["c"], "worker": ["w0", "w1"]}, ("chief", 0), Role(True, "chief", 0, 3)),
        (
            {"chief": ["c"], "worker": ["w0"], "evaluator": ["e"]},
            ("evaluator", 0),
            Role(True, "evaluator", 0, 2),
        ),
    ],
)
def test_role_says_chief_task_and_training_workers(
    cluster: dict | None, task: tuple, expected: Role
) -> None:
    assert role(cluster, *task) == expected


def test_parsed_tf_config_and_role_agree() -> None:
    info = parse_tf_config(tfjob("worker", 1), env={})
    assert role(json.loads(tfjob("worker", 1))["cluster"], "worker", 1) == Role(
        info.is_chief, info.task_type, info.task_id, info.num_workers
    )


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


def test_slurm_auto_ports_follow_the_job_and_step_ids() -> None:
    # port_base None (the config's auto): from SLURM_JOB_ID / SLURM_STEP_ID, not TensorFlow's 8888.
    info = parse_slurm_env({**_slurm_env(1), "SLURM_STEP_ID": "0"})
    assert info.worker_addresses == ["localhost:29712", "localhost:29713"]
    assert (
        parse_slurm_env({**_slurm_env(1), "SLURM_STEP_ID": "0"}, port_base=9000).worker_addresses[0]
        == "localhost:9000"
    )


def test_slurm_auto_port_base_examples() -> None:
    # The examples of slurm_port_base's docstring: the next job's slot, the next step's, no job id.
    assert slurm_port_base({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}) == 29712
    assert slurm_port_base({"SLURM_JOB_ID": "78", "SLURM_STEP_ID": "0"}) - 29712 == 256
    assert slurm_port_base({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1"}) - 29712 == 16
    assert slurm_port_base({}) == 8888


def test_training_tasks_are_the_chief_then_the_workers_without_ps_or_evaluator() -> None:
    cluster = {"chief": ["a:1"], "worker": ["b:1", "c:1"], "ps": ["d:1"], "evaluator": ["e:1"]}
    assert list(training_tasks(cluster).items()) == [
        (("chief", 0), "a:1"),
        (("worker", 0), "b:1"),
        (("worker", 1), "c:1"),
    ]
    assert training_tasks({"worker": {"1": "c:1"}}) == {("worker", 1): "c:1"}  # sparse form


def test_slurm_auto_ports_of_neighbouring_jobs_and_steps_do_not_overlap() -> None:
    # Two jobs (or two steps of one job) on one node, up to 16 tasks per node each: disjoint blocks,
    # all in 10000-31775 (below Linux's ephemeral ports, 32768 on).
    def block(job: int, step: int) -> range:
        base = slurm_port_base({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)})
        return range(base, base + 16)

    for job in range(1, 3000):
        for a, b in [
            (block(job, 0), block(job + 1, 0)),
            (block(job, 0), block(job, 1)),
            (block(job, 3), block(job + 7, 3)),
        ]:
            assert not set(a) & set(b), (job, a, b)
            assert a[0] >= 10000 and b[-1] <= 31775
    assert (
        block(12345, 4294967294)[0] == block(12345, 4294967294 % 16)[0]
    )  # the batch step's huge id


def test_slurm_hostlist_and_tasks_per_node_like_tensorflow() -> None:
    assert expand_hostlist("gpu[01-02,07],login") == ["gpu01", "gpu02", "gpu07", "login"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    # The examples the docstrings had.
    assert expand_hostlist("n[1-2],m5,o[08-10]") == ["n1", "n2", "m5", "o08", "o09", "o10"]
    assert expand_tasks_per_node("3(x2),1") == [3, 3, 1]
    env = {
        "SLURM_PROCID": "0",
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_STEP_NODELIST": "nb,na[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
    }
    assert parse_slurm_env(env).worker_addresses == [
        "na1:8888",
        "na2:8888",
        "nb:8888",
    ]  # sorted, as TF does


def test_slurm_outside_a_step_says_use_srun() -> None:
    with pytest.raises(
        ClusterError,
        match=r"SLURM_STEP_NUM_TASKS.*are not set.*Received: SLURM_JOB_ID='77'.*srun python train.py",
    ):
        parse_slurm_env(
            {
                "SLURM_JOB_ID": "77",
                "SLURM_PROCID": "0",
                "SLURM_STEP_NODELIST": "x",
                "SLURM_STEP_TASKS_PER_NODE": "1",
            }
        )


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


def test_read_cluster_reads_only_the_source_strategy_cluster_names() -> None:
    from keras_sync.config import load_config

    env = {"TF_CONFIG": PLAIN_W0, **_slurm_env(1), INDEX_VAR: "1"}
    job = {"hosts": "train-{index}.train", "port": 2222, "workers": 3}
    for source, expected in [
        ("tf_config", "tf_config"),
        ("slurm", "slurm"),
        ("indexed_job", "indexed_job"),
    ]:
        cfg = load_config(
            {"strategy": {"kind": "multi_worker_mirrored", "cluster": source, "indexed_job": job}}
        )
        info, _where = read_cluster(cfg.strategy, env)
        assert info.source == expected
        assert read_cluster(cfg.strategy, {}) == (SINGLE_PROCESS, _where_absent(source))
    assert set(CLUSTER_SOURCES) == {"tf_config", "slurm", "indexed_job"}


def test_each_cluster_environment_detects_its_variables_and_tells_world_size_and_rank() -> None:
    from keras_sync.cluster import ClusterEnvironment
    from keras_sync.config import load_config

    env = {"TF_CONFIG": PLAIN_W0, **_slurm_env(1), INDEX_VAR: "2"}
    job = {"hosts": "train-{index}.train", "port": 2222, "workers": 3}
    expected = {"tf_config": (2, 0), "slurm": (2, 1), "indexed_job": (3, 2)}
    for name, cls in CLUSTER_SOURCES.items():
        cfg = load_config(
            {"strategy": {"kind": "multi_worker_mirrored", "cluster": name, "indexed_job": job}}
        )
        assert issubclass(cls, ClusterEnvironment) and cls.name == name
        here, absent = cls(cfg.strategy, env), cls(cfg.strategy, {})
        assert here.detect() and not absent.detect()
        assert (here.world_size(), here.rank()) == expected[name]
    alone = ClusterEnvironment()
    assert alone.detect() and (alone.world_size(), alone.rank(), alone.resolver()) == (1, 0, None)


def _where_absent(source: str) -> str:
    return {
        "tf_config": "TF_CONFIG unset",
        "slurm": "no Slurm job ($SLURM_PROCID unset)",
        "indexed_job": f"no Indexed Job (${INDEX_VAR} unset)",
    }[source]


def test_order_check_catches_tf_config_changed_after_strategy() -> None:
    record_strategy_tf_config(PLAIN_W0)
    try:
        check_tf_config_order(PLAIN_W0)
        check_tf_config_order(
            json.dumps(json.loads(PLAIN_W0), indent=2)
        )  # same cluster, other spelling
        with pytest.raises(
            ClusterError,
            match=r"TF_CONFIG changed after keras_sync built a strategy.*Received: TF_CONFIG=.*index.: 1.*before `keras_sync.load\(\)`",
        ):
            check_tf_config_order(PLAIN_W0.replace('"index": 0', '"index": 1'))
        with pytest.raises(ClusterError, match="TF_CONFIG changed"):
            check_tf_config_order(None, env={})
    finally:
        from keras_sync import cluster

        cluster._recorded.clear()


@pytest.mark.slow
def test_against_tensorflow_resolvers_and_a_real_strategy() -> None:
    """TF's own resolvers and `is_chief` agree with the pure parsers; a joined cluster is detected."""
    examples = [
        tfjob("chief", 0),
        tfjob("worker", 0),
        tfjob("worker", 1),
        tfjob("evaluator", 0),
        RAY,
        PLAIN_W0,
    ]
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
        assert (ours.task_type, ours.task_id, ours.is_chief) == (
            tf_view["task_type"],
            tf_view["task_id"],
            tf_view["is_chief"],
        )
        assert (
            ours.worker_addresses
            == tf_view["cluster"].get("chief", []) + tf_view["cluster"]["worker"]
        )

    slurm = result["slurm"]
    expected = parse_slurm_env(_slurm_env(1), port_base=port_base)
    assert slurm["cluster"] == {"worker": expected.worker_addresses}
    assert (slurm["task_type"], slurm["task_id"]) == ("worker", 1)
    assert slurm["num_accelerators"] == {}  # no phantom GPU on a CPU machine
    assert slurm["cuda_visible_devices"] is None

    order = result["order"]
    assert order["replicas"] == 1
    assert re.search("TF_CONFIG changed after keras_sync built a strategy", order["recorded"])
    assert re.search(
        r"TensorFlow in this process already joined the cluster .*127\.0\.0\.1.* as worker:0",
        order["tf_context"],
    )


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
def test_two_slurm_tasks_all_reduce_with_the_slurm_resolver(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two processes with srun-like variables on 127.0.0.1 build a real MultiWorkerMirroredStrategy."""
    port_base = _two_consecutive_free_ports()
    code = launch(
        str(ROOT / "tests" / "_launch_tf_worker.py"),
        ["slurm", str(port_base)],
        workers=2,
        grace_period_s=1,
    )
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    results = [
        json.loads(line.partition(" ")[2])
        for line in sorted(out.splitlines())
        if '{"task_id"' in line
    ]
    assert [
        (r["task_id"], r["sum"], r["replicas"], r["is_chief"], r["tf_is_chief"]) for r in results
    ] == [
        (0, 3.0, 2, True, True),
        (1, 3.0, 2, False, False),
    ]


# ---------------------------------------------------------------- Kubernetes Indexed Job / JobSet

from keras_sync.cluster import indexed_job_addresses, parse_indexed_job  # noqa: E402


def test_indexed_job_pod_is_worker_of_its_completion_index() -> None:
    info = parse_indexed_job("train-{index}.train", 2222, 3, {INDEX_VAR: "1"})
    assert info == ClusterInfo(
        "indexed_job",
        "worker",
        1,
        3,
        False,
        ["train-0.train:2222", "train-1.train:2222", "train-2.train:2222"],
    )
    assert parse_indexed_job("train-{index}.train", 2222, 3, {INDEX_VAR: "0"}).is_chief


def test_indexed_job_pattern_may_name_the_port() -> None:
    assert indexed_job_addresses("js-workers-0-{index}.js:3000{index}", 2222, 2) == [
        "js-workers-0-0.js:30000",
        "js-workers-0-1.js:30001",
    ]
    # The examples of the docstring indexed_job_addresses had: the port added, or the pattern's own.
    assert indexed_job_addresses("train-{index}.train", 2222, 2) == [
        "train-0.train:2222",
        "train-1.train:2222",
    ]
    assert indexed_job_addresses("127.0.0.1:2900{index}", 2222, 2) == [
        "127.0.0.1:29000",
        "127.0.0.1:29001",
    ]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {},
            r"\$JOB_COMPLETION_INDEX is not set. Received: JOB_COMPLETION_INDEX=None. Kubernetes sets it",
        ),
        (
            {INDEX_VAR: "2"},
            r"not a worker index from 0 to strategy.indexed_job.workers-1=1. Received: "
            r"JOB_COMPLETION_INDEX='2'. Set strategy.indexed_job.workers to the Job's `completions`",
        ),
        ({INDEX_VAR: "x"}, r"Received: JOB_COMPLETION_INDEX='x'"),
    ],
)
def test_bad_indexed_job_env(env: dict[str, str], message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        parse_indexed_job("w-{index}", 2222, 2, env)


@pytest.mark.parametrize(
    ("indexed_job", "message"),
    [
        (
            {"workers": 2},
            r"strategy.indexed_job.hosts: received null with strategy.cluster=indexed_job",
        ),
        (
            {"hosts": "w-{index}"},
            r"strategy.indexed_job.workers: received null with strategy.cluster=indexed_job",
        ),
        (
            {"hosts": "w-0", "workers": 2},
            r"strategy.indexed_job.hosts: received 'w-0', expected a host pattern with \{index\} "
            r"\(one host per worker\), e.g. train-\{index\}.train",
        ),
        (
            {"hosts": "w-{index}", "workers": 2, "port": 70000},
            r"strategy.indexed_job.port: received 70000, expected a TCP port from 1 to 65535",
        ),
    ],
)
def test_indexed_job_config_errors_name_the_key(indexed_job: dict, message: str) -> None:
    from keras_sync.config import load_config
    from keras_sync.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config({"strategy": {"cluster": "indexed_job", "indexed_job": indexed_job}})


def test_auto_counts_indexed_job_workers_only_inside_a_job() -> None:
    from keras_sync.config import load_config
    from keras_sync.strategy import detect

    cfg = load_config(
        {
            "strategy": {
                "cluster": "indexed_job",
                "indexed_job": {"hosts": "w-{index}.w", "workers": 4},
            }
        }
    )
    assert detect(cfg, {INDEX_VAR: "3"}, gpus=0).kind == "multi_worker_mirrored"
    assert "Indexed Job names 4 workers" in detect(cfg, {INDEX_VAR: "3"}, gpus=0).reason
    assert detect(cfg, {}, gpus=0).kind == "default"


def _consecutive_free_ports() -> str:
    """A prefix P such that ports P0 and P1 are free on 127.0.0.1 (the pattern "127.0.0.1:P{index}")."""
    import random

    for _ in range(200):
        prefix = str(random.randint(2000, 6000))
        socks = [socket.socket() for _ in range(2)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", int(f"{prefix}{i}")))
            return prefix
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no two free consecutive ports found")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_indexed_job_two_local_workers_through_the_pattern_equal_one_process(
    tmp_path: Path,
) -> None:
    import os

    import numpy as np

    train = Path(__file__).parent / "_mwr_train.py"
    # One process under multi_worker_mirrored too: arrays then take keras-sync's seeded shuffle, as in the job.
    base = {
        "strategy": {"kind": "multi_worker_mirrored"},
        "batch": {"global": 32},
        "learning_rate": {"base": 0.01, "base_batch_size": 32},
        "mlflow": {"enabled": False},
    }
    job = {
        **base,
        "strategy": {
            "kind": "auto",
            "cluster": "indexed_job",
            "connect_timeout_s": 120,
            "indexed_job": {
                "hosts": f"127.0.0.1:{_consecutive_free_ports()}{{index}}",
                "workers": 2,
            },
        },
    }
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "KERAS_SYNC_CONFIG", INDEX_VAR)
    }
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    procs = [
        subprocess.Popen(
            [sys.executable, str(train), json.dumps(job), str(tmp_path / "job"), "--epochs", "2"],
            env={**env, INDEX_VAR: str(i)},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    alone = subprocess.Popen(
        [sys.executable, str(train), json.dumps(base), str(tmp_path / "one"), "--epochs", "2"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        logs = [p.communicate(timeout=480)[0] for p in [*procs, alone]]
    finally:
        for p in [*procs, alone]:
            if p.poll() is None:
                p.kill()
    for p, log in zip([*procs, alone], logs):
        assert p.returncode == 0, log[-4000:]
    w = [json.loads((tmp_path / "job" / f"w{i}.json").read_text()) for i in range(2)]
    one = json.loads((tmp_path / "one" / "w0.json").read_text())
    assert [(r["task"], r["num_workers"], r["num_replicas"]) for r in w] == [(0, 2, 2), (1, 2, 2)]
    for r in w:
        diff = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(r["weights"], one["weights"])
        )
        assert diff <= 1e-5, diff


def _manifest(name: str) -> list[dict]:
    import yaml

    path = Path(__file__).resolve().parents[1] / "examples" / "kubernetes" / name
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _example_config(docs: list[dict], tmp_path: Path):
    from keras_sync.config import load_config

    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    path = tmp_path / "keras_sync.yaml"
    path.write_text(cm["data"]["keras_sync.yaml"])
    return load_config(path).strategy


def test_example_indexed_job_manifest_matches_its_config(tmp_path: Path) -> None:
    docs = _manifest("indexed-job.yaml")
    s = _example_config(docs, tmp_path)
    (job,) = [d for d in docs if d["kind"] == "Job"]
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (
        spec["completionMode"] == "Indexed"
        and spec["completions"] == spec["parallelism"] == s.indexed_job.workers
    )
    assert pod["subdomain"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    info = parse_indexed_job(
        s.indexed_job.hosts, s.indexed_job.port, s.indexed_job.workers, {INDEX_VAR: "1"}
    )
    name = job["metadata"]["name"]  # Kubernetes names pod i of an Indexed Job <job>-<i>
    assert info.worker_addresses == [
        f"{name}-{i}.{pod['subdomain']}:{s.indexed_job.port}" for i in range(2)
    ]
    assert pod["containers"][0]["ports"][0]["containerPort"] == s.indexed_job.port


def test_example_jobset_manifest_matches_its_config(tmp_path: Path) -> None:
    docs = _manifest("jobset.yaml")
    s = _example_config(docs, tmp_path)
    (js,) = [d for d in docs if d["kind"] == "JobSet"]
    (rjob,) = js["spec"]["replicatedJobs"]
    spec = rjob["template"]["spec"]
    assert (
        rjob["replicas"] == 1
        and spec["completions"] == spec["parallelism"] == s.indexed_job.workers
    )
    name = js["metadata"][
        "name"
    ]  # JobSet: pod i of job 0 is <jobset>-<replicated job>-0-<i>, subdomain <jobset>
    assert indexed_job_addresses(s.indexed_job.hosts, s.indexed_job.port, 2) == [
        f"{name}-{rjob['name']}-0-{i}.{name}:{s.indexed_job.port}" for i in range(2)
    ]


def test_only_a_ray_worker_is_killed_when_training_returns():
    from keras_sync.cluster import killed_when_training_returns

    assert killed_when_training_returns(RAY_ENV)
    assert not killed_when_training_returns({"TF_CONFIG": "{}", "SLURM_JOB_ID": "7"})


def test_slurm_hostlist_takes_linear_time_on_a_long_value() -> None:
    # The regex split retried at every '[': 1.3 s for 20,000 of them, ~100 times that for 200,000.
    started = time.perf_counter()
    with pytest.raises(ValueError, match="bad part"):
        expand_hostlist("[" * 200_000)
    assert len(expand_hostlist("n1," * 50_000)) == 50_000
    assert time.perf_counter() - started < 2.0
