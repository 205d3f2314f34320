"""Where this process sits in a training cluster: TF_CONFIG, Slurm, a Kubernetes Indexed Job, or alone.

The parsers here are pure (no TensorFlow), so `keras-sync plan` can show the
cluster without paying for a TensorFlow import. Only `slurm_cluster_resolver`
and the TensorFlow half of `check_tf_config_order` touch TensorFlow, lazily.

Chief rule (TensorFlow's own, `multi_worker_util.is_chief`):
the `chief` task if the cluster has one, else `worker` 0; an `evaluator` is
not part of the training cluster and is a chief of its own.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from keras_sync.errors import ClusterError

# The jobs that train together (one all-reduce); `evaluator` and `ps` never join the collectives.
TRAINING_JOBS = ("chief", "worker")
_ALLOWED_JOBS = (*TRAINING_JOBS, "evaluator", "ps")
_SLURM_PORT_BASE = 8888  # SlurmClusterResolver's default `port_base`: only without $SLURM_JOB_ID.
# strategy.slurm.port_base: auto gives each (job, step) a slot of 16 ports in 10000-31775, below
# Linux's ephemeral range (32768-60999) so an outgoing connection never holds a worker's port.
# The slot count is a prime: consecutive job ids (and steps) land in different slots.
_SLURM_AUTO_FIRST_PORT = 10000
_SLURM_AUTO_SLOTS = 1361
SLURM_AUTO_PORTS_PER_SLOT = 16


@dataclass(frozen=True)
class ClusterInfo:
    """This process's place in the cluster, as read from the environment.

    Attributes:
        source: "tf_config", "slurm", "indexed_job" or "none" (a single process).
        task_type: "chief", "worker" or "evaluator".
        task_id: index of this task within `task_type`.
        num_workers: number of training tasks (chief + workers).
        is_chief: whether this task is the chief (see the module docstring).
        worker_addresses: "host:port" of the training tasks, chief first.
        flavor: who wrote the cluster description: "kubeflow" (TFJob, also
            Vertex AI: `"environment": "cloud"`), "ray" (Ray Train) or "plain".
            Only shown to people: how the data is sharded is decided by the data
            (`keras_sync.training.pipeline`), never by who wrote TF_CONFIG.
    """

    source: Literal["tf_config", "slurm", "indexed_job", "none"]
    task_type: str
    task_id: int
    num_workers: int
    is_chief: bool
    worker_addresses: list[str] = field(default_factory=list)
    flavor: Literal["kubeflow", "ray", "plain"] = "plain"


SINGLE_PROCESS = ClusterInfo("none", "worker", 0, 1, True)


@dataclass(frozen=True)
class Role:
    """This process's part in the training job: does it write (chief), which task is it, how many train.

    Attributes:
        is_chief: the one process with side effects (MLflow, files, printing).
        task_type: "chief", "worker" or "evaluator"; None for a single process.
        task_id: index within `task_type`; None for a single process.
        num_workers: training tasks (chief + workers); 1 for a single process.
    """

    is_chief: bool
    task_type: str | None
    task_id: int | None
    num_workers: int


SINGLE = Role(is_chief=True, task_type=None, task_id=None, num_workers=1)


def role(cluster: Mapping[str, Any] | None, task_type: str | None, task_id: int | None) -> Role:
    """The role of task (`task_type`, `task_id`) in `cluster` (``{job: [addresses]}``): the one rule.

    >>> role({"chief": ["c:1"], "worker": ["w:1", "w:2"]}, "worker", 0)
    Role(is_chief=False, task_type='worker', task_id=0, num_workers=3)
    >>> role(None, None, None) == SINGLE
    True
    """
    if not cluster or task_type is None:
        return SINGLE
    workers = sum(len(cluster.get(job) or ()) for job in TRAINING_JOBS)
    return Role(is_chief(cluster, task_type, task_id or 0), task_type, task_id, max(workers, 1))


def strategy_role(strategy: Any) -> Role:
    """The `Role` of this process in `strategy`'s cluster (`SINGLE` without one). No TensorFlow import:
    reads the strategy's cluster resolver, which multi-worker strategies carry."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return SINGLE
    # {job: [addresses]} (or {job: {index: address}} when sparse)
    spec = resolver.cluster_spec().as_dict()
    return role(spec, resolver.task_type, resolver.task_id)


def in_ray_worker(env: Mapping[str, str] | None = None) -> bool:
    """True in a process Ray started (its raylet sets ``RAY_RAYLET_PID`` in every worker)."""
    return "RAY_RAYLET_PID" in (os.environ if env is None else env)


def killed_when_training_returns(env: Mapping[str, str] | None = None) -> bool:
    """True where the job manager kills the process tree as soon as training returns, atexit unrun.

    Ray Train ends each worker, and every process the worker started, once the train function
    returns. What must reach MLflow is delivered before `Sync.fit` returns there.
    """
    return in_ray_worker(env)


def is_chief(cluster: Mapping[str, Any], task_type: str, task_id: int) -> bool:
    """The chief rule of TensorFlow's `multi_worker_util.is_chief`.

    >>> is_chief({"chief": ["a:1"], "worker": ["b:1"]}, "worker", 0)
    False
    >>> is_chief({"worker": ["a:1", "b:1"]}, "worker", 0)
    True
    >>> is_chief({"worker": ["a:1"]}, "evaluator", 0)
    True
    """
    if task_type in ("chief", "evaluator"):
        return True
    return "chief" not in cluster and task_type == "worker" and task_id == 0


def chief_task(cluster: Mapping[str, Any]) -> tuple[str, int]:
    """The task `is_chief` names among the training jobs; TensorFlow's coordination service runs there too.

    >>> chief_task({"chief": ["a:1"], "worker": ["b:1"]}), chief_task({"worker": ["a:1", "b:1"]})
    (('chief', 0), ('worker', 0))
    """
    return ("chief", 0) if cluster.get("chief") else ("worker", 0)


def _error(what: str, received: Any, fix: str) -> ClusterError:
    shown = received if len(str(received)) < 300 else str(received)[:300] + "..."
    return ClusterError(f"{what}. Received: {shown}. {fix}")


def _load_tf_config(raw: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _error(
            f"TF_CONFIG is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}, char {e.pos})",
            f"TF_CONFIG={raw!r}",
            "Expected a JSON object such as "
            '{"cluster": {"worker": ["host0:2222", "host1:2222"]}, "task": {"type": "worker", "index": 0}}; '
            "fix the quoting where TF_CONFIG is set (shell quotes, the job spec).",
        ) from None
    if not isinstance(data, dict):
        raise _error(
            "TF_CONFIG must be a JSON object",
            f"TF_CONFIG={raw!r}",
            'Expected {"cluster": ..., "task": ...}.',
        )
    return data


def parse_tf_config(raw: str | None, *, env: Mapping[str, str] | None = None) -> ClusterInfo:
    """Reads a TF_CONFIG value (Kubeflow TFJob, Ray Train, Vertex AI or hand-written).

    Args:
        raw: the TF_CONFIG string; None, "" or "{}" mean a single process.
        env: the environment, only to recognise Ray workers (default `os.environ`).

    Raises:
        ClusterError: invalid JSON, `sparseCluster` or `ps` (not supported by
            MultiWorkerMirroredStrategy), a missing task, an index out of range.
    """
    if raw is None or not raw.strip():
        return SINGLE_PROCESS
    data = _load_tf_config(raw)
    if not data:
        return SINGLE_PROCESS
    if "sparseCluster" in data:
        raise _error(
            "TF_CONFIG has `sparseCluster` (a TFJob with enableDynamicWorker), which is not supported by "
            "MultiWorkerMirroredStrategy: every worker must know every peer",
            f"sparseCluster={data['sparseCluster']!r}",
            "Fix: set `enableDynamicWorker: false` in the TFJob spec so it writes a full `cluster`.",
        )
    cluster = data.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        raise _error(
            "TF_CONFIG has no `cluster` (or it is not a non-empty object)",
            f"cluster={cluster!r}",
            'Expected e.g. "cluster": {"worker": ["host0:2222", "host1:2222"]}; unset TF_CONFIG to train in one process.',
        )
    for job, addresses in cluster.items():
        if job not in _ALLOWED_JOBS:
            raise _error(
                f"TF_CONFIG cluster has an unknown job `{job}`",
                f"cluster={cluster!r}",
                f"Expected only {', '.join(TRAINING_JOBS)} (and evaluator); rename the job.",
            )
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise _error(
                f"TF_CONFIG cluster.{job} must be a list of 'host:port' strings",
                f"cluster.{job}={addresses!r}",
                f'Expected e.g. "{job}": ["host0:2222"].',
            )
    if cluster.get("ps"):
        raise _error(
            "TF_CONFIG cluster has `ps` tasks, which are not supported by MultiWorkerMirroredStrategy "
            "(keras-sync does data-parallel all-reduce, not parameter servers)",
            f"cluster.ps={cluster['ps']!r}",
            "Fix: remove the PS replicas (TFJob `PS:` replica spec) and run chief/worker replicas only.",
        )
    for job in ("chief", "evaluator"):
        if len(cluster.get(job, [])) > 1:
            raise _error(
                f"TF_CONFIG cluster.{job} must have at most one task",
                f"cluster.{job}={cluster[job]!r}",
                f"Fix: set `replicas: 1` for the {job.capitalize()} replica spec.",
            )
    training = [a for job in TRAINING_JOBS for a in cluster.get(job, [])]
    if not training:
        raise _error(
            "TF_CONFIG cluster has no `chief` or `worker` tasks",
            f"cluster={cluster!r}",
            "Add a worker list.",
        )

    task = data.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise _error(
            "TF_CONFIG has no `task` (this process's role)",
            f"task={task!r}",
            'Expected e.g. "task": {"type": "worker", "index": 0}, different on each process.',
        )
    task_type, task_id = task.get("type"), task.get("index")
    if task_type not in (*TRAINING_JOBS, "evaluator"):
        raise _error(
            "TF_CONFIG task.type is not a training role",
            f"task.type={task_type!r}",
            "Expected one of chief, worker, evaluator.",
        )
    if isinstance(task_id, str) and task_id.isdigit():
        task_id = int(task_id)  # TFConfigClusterResolver does int(index) too
    if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
        raise _error(
            "TF_CONFIG task.index must be an integer >= 0",
            f"task.index={task_id!r}",
            "Fix the task index.",
        )
    if task_type != "evaluator" or task_type in cluster:
        count = len(cluster.get(task_type, []))
        if task_id >= count:
            raise _error(
                f"TF_CONFIG task.index is out of range for `{task_type}` ({count} task(s) in cluster.{task_type})",
                f"task={task!r}",
                f"Expected an index from 0 to {count - 1}; give each process its own index.",
            )

    env = os.environ if env is None else env
    flavor: Literal["kubeflow", "ray", "plain"] = "plain"
    if str(data.get("environment", "")).lower() == "cloud":
        flavor = "kubeflow"
    elif set(cluster) == {"worker"} and in_ray_worker(env):
        # Ray Train's TensorflowConfig writes only a worker list.
        flavor = "ray"
    return ClusterInfo(
        source="tf_config",
        task_type=task_type,
        task_id=task_id,
        num_workers=role(cluster, task_type, task_id).num_workers,
        is_chief=role(cluster, task_type, task_id).is_chief,
        worker_addresses=training,
        flavor=flavor,
    )


def tf_config_cluster_resolver(env: Mapping[str, str] | None = None) -> Any:
    """TensorFlow's `TFConfigClusterResolver`, after TF_CONFIG passed `parse_tf_config`.

    Validating first turns TensorFlow's late, terse failures (a KeyError deep in
    the strategy, or a hang) into a `ClusterError` that says what to fix.
    TensorFlow reads `os.environ["TF_CONFIG"]` itself.
    """
    parse_tf_config(os.environ.get("TF_CONFIG"), env=env)
    import tensorflow as tf

    return tf.distribute.cluster_resolver.TFConfigClusterResolver()


# ---------------------------------------------------------------- Slurm

_SLURM_VARS = (
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a Slurm hostlist, keeping order, as TensorFlow's resolver does.

    >>> expand_hostlist("n[1-2],m5,o[08-10]")
    ['n1', 'n2', 'm5', 'o08', 'o09', 'o10']
    """
    hosts: list[str] = []
    for part in _hostlist_parts(hostlist):
        m = re.fullmatch(r"([^\[\]]*)(?:\[([^\]]+)\])?", part)
        if m is None or (not m.group(1) and m.group(2) is None):
            raise ValueError(f"bad part {part[:80]!r}")
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(prefix + str(i).zfill(len(lo)))
    return hosts


def _hostlist_parts(hostlist: str) -> list[str]:
    """The comma-separated parts of a hostlist, a comma inside [...] not separating (one pass: a
    regex that retried at every '[' took time quadratic in the text)."""
    parts: list[str] = []
    start, inside = 0, False
    for i, ch in enumerate(hostlist):
        if ch in "[]":
            inside = ch == "["
        elif ch == "," and not inside:
            parts.append(hostlist[start:i])
            start = i + 1
    parts.append(hostlist[start:])
    return [p for p in parts if p]


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expands SLURM_STEP_TASKS_PER_NODE.

    >>> expand_tasks_per_node("3(x2),1")
    [3, 3, 1]
    """
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"bad part {part!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def slurm_port_base(env: Mapping[str, str] | None = None) -> int:
    """The first worker port of this Slurm job step when `strategy.slurm.port_base` is auto.

    TensorFlow's `SlurmClusterResolver` puts every job on ports 8888, 8889, ...: two jobs (or two
    steps of one job) that share a node then fail with "Could not start gRPC server". Auto gives
    each (job id, step id) its own slot of 16 ports, so up to 16 tasks per node never collide with
    a neighbouring job's; the same environment always gives the same ports, on every node.

    >>> slurm_port_base({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"})
    29712
    >>> slurm_port_base({"SLURM_JOB_ID": "78", "SLURM_STEP_ID": "0"}) - 29712   # the next job
    256
    >>> slurm_port_base({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1"}) - 29712   # the job's next step
    16
    >>> slurm_port_base({})   # no job id (an srun look-alike): TensorFlow's default
    8888
    """
    env = os.environ if env is None else env
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "0")
    if not job.isdigit():
        return _SLURM_PORT_BASE
    key = (
        int(job) * SLURM_AUTO_PORTS_PER_SLOT
        + (int(step) if step.isdigit() else 0) % SLURM_AUTO_PORTS_PER_SLOT
    )
    return _SLURM_AUTO_FIRST_PORT + (key % _SLURM_AUTO_SLOTS) * SLURM_AUTO_PORTS_PER_SLOT


def parse_slurm_env(
    env: Mapping[str, str] | None = None, *, port_base: int | None = None
) -> ClusterInfo:
    """Reads a Slurm job step (`srun`) the way `SlurmClusterResolver` does, without TensorFlow.

    Every task is a `worker`; task i listens on its node at `port_base + i-th task on
    that node`; nodes are taken in sorted order (TensorFlow sorts them too). ``port_base``
    None: `slurm_port_base` of the environment (the config's auto).
    """
    env = os.environ if env is None else env
    missing = [v for v in _SLURM_VARS if v not in env]
    if missing:
        raise _error(
            f"Slurm variable(s) {', '.join(missing)} are not set",
            f"SLURM_JOB_ID={env.get('SLURM_JOB_ID')!r}",
            "The SLURM_STEP_* variables exist only inside a job step: start the script with "
            "`srun python train.py`, not directly from the batch script.",
        )
    try:
        rank = int(env["SLURM_PROCID"])
        num_tasks = int(env["SLURM_STEP_NUM_TASKS"])
        hosts = expand_hostlist(env["SLURM_STEP_NODELIST"])
        per_node = expand_tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
    except ValueError as e:
        raise _error(
            f"Slurm variables cannot be read ({e})",
            {v: env[v] for v in _SLURM_VARS},
            "They are set by srun; do not set them by hand unless you mimic srun exactly.",
        ) from None
    layout = dict(zip(hosts, per_node))
    if port_base is None:
        port_base = slurm_port_base(env)
    addresses = [f"{h}:{port_base + i}" for h, n in sorted(layout.items()) for i in range(n)]
    if len(addresses) != num_tasks or not 0 <= rank < num_tasks:
        raise _error(
            "Slurm variables disagree: the node list and tasks per node do not give SLURM_STEP_NUM_TASKS "
            "tasks, or SLURM_PROCID is out of range",
            {v: env[v] for v in _SLURM_VARS},
            "Run under srun with one task per worker process.",
        )
    return ClusterInfo("slurm", "worker", rank, num_tasks, rank == 0, addresses)


def slurm_cluster_resolver(
    *, port_base: int | None = None, env: Mapping[str, str] | None = None
) -> Any:
    """A TensorFlow cluster resolver for the current Slurm job step.

    Uses `tf.distribute.cluster_resolver.SlurmClusterResolver`, which reads the
    SLURM_* variables of `os.environ` (no `scontrol`, no DNS: host names go into
    the cluster spec as they are). On a machine without GPUs its GPU bookkeeping
    would give each task a GPU that does not exist (and zero GPUs per task makes
    it drop every task), so there the result is frozen into a
    `SimpleClusterResolver` that reports no accelerators.
    """
    if port_base is None:
        port_base = slurm_port_base(env)
    # clear errors before TensorFlow's RuntimeErrors
    info = parse_slurm_env(env, port_base=port_base)
    import tensorflow as tf

    resolvers = tf.distribute.cluster_resolver
    if tf.config.list_physical_devices("GPU"):
        return resolvers.SlurmClusterResolver(port_base=port_base)
    slurm = resolvers.SlurmClusterResolver(
        port_base=port_base, gpus_per_node=info.num_workers, gpus_per_task=1, auto_set_gpu=False
    )
    spec = slurm.cluster_spec()
    return resolvers.SimpleClusterResolver(
        spec,
        task_type=slurm.task_type,
        task_id=slurm.task_id,
        num_accelerators={},
        rpc_layer="grpc",
    )


# ------------------------------------------------- Kubernetes Indexed Job / JobSet

INDEX_VAR = "JOB_COMPLETION_INDEX"  # set by Kubernetes in every pod of an Indexed Job (JobSet too)


def indexed_job_addresses(hosts: str, port: int, workers: int) -> list[str]:
    """Every worker's ``host:port``: ``hosts`` with ``{index}`` = 0..workers-1, ``:port`` added
    unless the pattern names a port itself.

    >>> indexed_job_addresses("train-{index}.train", 2222, 2)
    ['train-0.train:2222', 'train-1.train:2222']
    >>> indexed_job_addresses("127.0.0.1:2900{index}", 2222, 2)
    ['127.0.0.1:29000', '127.0.0.1:29001']
    """
    out = []
    for i in range(workers):
        host = hosts.replace("{index}", str(i))
        out.append(host if re.search(r":\d+$", host) else f"{host}:{port}")
    return out


def parse_indexed_job(
    hosts: str | None, port: int, workers: int | None, env: Mapping[str, str] | None = None
) -> ClusterInfo:
    """This pod's place in a Kubernetes Indexed Job (or a JobSet's job): worker ``$JOB_COMPLETION_INDEX``
    of ``workers``, worker 0 the chief, addresses from the ``hosts`` pattern (`strategy.indexed_job`).

    With a headless Service named like the Job's pods' subdomain, pod i of Job ``train`` is
    ``train-{i}.<service>``; a JobSet pod is ``<jobset>-<replicated job>-<job index>-{i}.<jobset>``.
    """
    env = os.environ if env is None else env
    if not hosts or not workers:
        raise _error(
            "strategy.cluster is indexed_job but strategy.indexed_job.hosts or .workers is not set",
            f"hosts={hosts!r}, workers={workers!r}",
            "Set strategy.indexed_job.hosts (e.g. train-{index}.train) and .workers (the Job's completions).",
        )
    raw = env.get(INDEX_VAR)
    if raw is None:
        raise _error(
            f"strategy.cluster is indexed_job but ${INDEX_VAR} is not set",
            f"{INDEX_VAR}=None",
            "Kubernetes sets it in the pods of a Job with `completionMode: Indexed` (JobSet too); run the "
            "script there, or set it by hand (0 to workers-1) to mimic one.",
        )
    if not raw.strip().isdigit() or int(raw) >= workers:
        raise _error(
            f"${INDEX_VAR} is not a worker index from 0 to strategy.indexed_job.workers-1={workers - 1}",
            f"{INDEX_VAR}={raw!r}",
            "Set strategy.indexed_job.workers to the Job's `completions` (and `parallelism`), the same number.",
        )
    index = int(raw)
    return ClusterInfo(
        "indexed_job",
        "worker",
        index,
        workers,
        index == 0,
        indexed_job_addresses(hosts, port, workers),
    )


def indexed_job_cluster_resolver(
    hosts: str | None, port: int, workers: int | None, env: Mapping[str, str] | None = None
) -> Any:
    """A TensorFlow `SimpleClusterResolver` for this pod of an Indexed Job (see `parse_indexed_job`)."""
    info = parse_indexed_job(hosts, port, workers, env)
    import tensorflow as tf

    gpus = len(tf.config.list_physical_devices("GPU"))
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": info.worker_addresses}),
        task_type="worker",
        task_id=info.task_id,
        num_accelerators={"GPU": gpus} if gpus else {},
        rpc_layer="grpc",
    )


# ------------------------------------------------- One class per value of `strategy.cluster`


def fixed_slurm_port_base(strategy_config: Any) -> int | None:
    """`strategy.slurm.port_base` as set: an int, or None for auto (then `slurm_port_base` of the job's ids)."""
    base = strategy_config.slurm.port_base
    return base if isinstance(base, int) else None


class ClusterEnvironment:
    """Where this process sits in one kind of cluster: detected and read without TensorFlow.

    Args:
        strategy_config: the config's `strategy` section (``slurm``, ``indexed_job`` settings).
        env: the environment (default `os.environ`).
    """

    name = "alone"
    #: Where the place came from when `detect` is False, in words for `keras-sync plan`.
    absent = "one process"

    def __init__(self, strategy_config: Any = None, env: Mapping[str, str] | None = None):
        self.config = strategy_config
        self.env = os.environ if env is None else env

    def detect(self) -> bool:
        """Whether this process runs in such a cluster (its variables are set)."""
        return True

    def info(self) -> ClusterInfo:
        """This process's place; raises `ClusterError` naming what to fix when it is inconsistent."""
        return SINGLE_PROCESS

    def describe(self, info: ClusterInfo) -> str:
        return self.absent

    def world_size(self) -> int:
        return self.info().num_workers

    def rank(self) -> int:
        return self.info().task_id

    def resolver(self) -> Any:
        """The TensorFlow cluster resolver a strategy gets (None: TensorFlow reads TF_CONFIG)."""
        return None


class TFConfigEnvironment(ClusterEnvironment):
    """``TF_CONFIG``: Kubeflow TFJob, Ray Train, Vertex AI or hand-written."""

    name, absent = "tf_config", "TF_CONFIG unset"

    def detect(self) -> bool:
        return self.info().source != "none"

    def info(self) -> ClusterInfo:
        return parse_tf_config(self.env.get("TF_CONFIG"), env=self.env)

    def describe(self, info: ClusterInfo) -> str:
        return f"TF_CONFIG ({info.flavor})"


class SlurmEnvironment(ClusterEnvironment):
    """A Slurm job step (``srun``): every task a worker, ports from `strategy.slurm.port_base`."""

    name, absent = "slurm", "no Slurm job ($SLURM_PROCID unset)"

    def detect(self) -> bool:
        return "SLURM_PROCID" in self.env

    def info(self) -> ClusterInfo:
        return parse_slurm_env(self.env, port_base=fixed_slurm_port_base(self.config))

    def describe(self, info: ClusterInfo) -> str:
        return "Slurm"

    def resolver(self) -> Any:
        return slurm_cluster_resolver(port_base=fixed_slurm_port_base(self.config))


class IndexedJobEnvironment(ClusterEnvironment):
    """A pod of a Kubernetes Indexed Job or JobSet (`strategy.indexed_job`)."""

    name, absent = "indexed_job", f"no Indexed Job (${INDEX_VAR} unset)"

    def detect(self) -> bool:
        return INDEX_VAR in self.env

    def info(self) -> ClusterInfo:
        job = self.config.indexed_job
        return parse_indexed_job(job.hosts, job.port, job.workers, self.env)

    def describe(self, info: ClusterInfo) -> str:
        return "Indexed Job"

    def resolver(self) -> Any:
        job = self.config.indexed_job
        return indexed_job_cluster_resolver(job.hosts, job.port, job.workers)


#: The allowed values of `strategy.cluster` (`keras_sync.config` reads the names from here).
CLUSTER_SOURCES: dict[str, type[ClusterEnvironment]] = {
    c.name: c for c in (TFConfigEnvironment, SlurmEnvironment, IndexedJobEnvironment)
}


def read_cluster(
    strategy_config: Any, env: Mapping[str, str] | None = None
) -> tuple[ClusterInfo, str]:
    """This process's place in the cluster `strategy.cluster` names, and where that came from. No TensorFlow."""
    source = CLUSTER_SOURCES[strategy_config.cluster](strategy_config, env)
    if not source.detect():
        return SINGLE_PROCESS, source.absent
    info = source.info()
    return info, source.describe(info)


def cluster_resolver(strategy_config: Any) -> Any:
    """The TensorFlow cluster resolver for `strategy.cluster` (None: TensorFlow reads TF_CONFIG)."""
    return CLUSTER_SOURCES[strategy_config.cluster](strategy_config).resolver()


# ------------------------------------------------- TF_CONFIG order (tensorflow#60706)

_recorded: list[str | None] = []  # TF_CONFIG seen when keras_sync built a strategy


def _cluster_key(raw: str | None) -> tuple[Any, ...] | None:
    try:
        data = json.loads(raw) if raw and raw.strip() else {}
    except json.JSONDecodeError:
        return ("invalid", raw)
    if not isinstance(data, dict) or not data.get("cluster"):
        return None
    cluster = {k: list(v) for k, v in sorted(data["cluster"].items()) if v}
    task = data.get("task") or {}
    return (json.dumps(cluster, sort_keys=True), task.get("type"), task.get("index"))


def record_strategy_tf_config(raw: str | None) -> None:
    """Remembers the TF_CONFIG a strategy was built with (called by the strategy factory)."""
    _recorded[:] = [raw]


def _tf_context_cluster() -> tuple[Any, ...] | None:
    """The cluster TensorFlow's eager context already joined, if TensorFlow is loaded."""
    if "tensorflow" not in sys.modules:
        return None
    from keras_sync.upstream.multi_worker import joined_cluster

    joined = joined_cluster()
    if joined is None:
        return None
    cluster = {k: v for k, v in sorted(joined[0].items()) if v}
    return (json.dumps(cluster, sort_keys=True), joined[1], joined[2])


def check_tf_config_order(raw: str | None = None, *, env: Mapping[str, str] | None = None) -> None:
    """Raises if TF_CONFIG differs from the cluster this process already built a strategy for.

    TensorFlow reads TF_CONFIG once, when a strategy is built, and a process can
    join only one cluster (tensorflow#60706): a TF_CONFIG set or changed later is
    silently ignored and the job trains in the wrong cluster or hangs.
    """
    if raw is None:
        raw = (os.environ if env is None else env).get("TF_CONFIG")
    now = _cluster_key(raw)
    fix = (
        "TensorFlow reads TF_CONFIG once, when the first strategy is built (tensorflow#60706). "
        "Fix: set TF_CONFIG in the environment before the process starts, or at least before "
        "`keras_sync.load()` and any TensorFlow work, and do not change it afterwards."
    )
    if _recorded and _cluster_key(_recorded[0]) != now:
        raise _error(
            f"TF_CONFIG changed after keras_sync built a strategy in this process (it was {_recorded[0]!r})",
            f"TF_CONFIG={raw!r}",
            fix,
        )
    joined = _tf_context_cluster()
    if joined is not None and joined != now:
        raise _error(
            f"TensorFlow in this process already joined the cluster {joined[0]} as {joined[1]}:{joined[2]}, "
            "which TF_CONFIG no longer describes",
            f"TF_CONFIG={raw!r}",
            fix,
        )
