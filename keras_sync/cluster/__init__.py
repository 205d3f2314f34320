"""Where this process sits in a training cluster: TF_CONFIG, Slurm, a Kubernetes Indexed Job, or alone.

One `ClusterEnvironment` per value of `strategy.cluster`: `detect` and `info` need no TensorFlow,
`resolver` imports it. The chief is TensorFlow's: the `chief` task, else `worker` 0; an
`evaluator` is outside the training cluster and a chief of its own.
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

TRAINING_JOBS = ("chief", "worker")  # one all-reduce; `evaluator` and `ps` never join it
INDEX_VAR = "JOB_COMPLETION_INDEX"  # set by Kubernetes in every pod of an Indexed Job (JobSet too)
_SLURM_VARS = (
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
)
Env = Mapping[str, str] | None  # the environment variables to read (None: os.environ)


@dataclass(frozen=True)
class ClusterInfo:
    """This process's place; ``worker_addresses`` chief first; ``flavor``: who wrote TF_CONFIG."""

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
    """This process's part in the job: chief or not, its task, how many workers train."""

    is_chief: bool
    task_type: str | None
    task_id: int | None
    num_workers: int


SINGLE = Role(is_chief=True, task_type=None, task_id=None, num_workers=1)


def role(cluster: Mapping[str, Any] | None, task_type: str | None, task_id: int | None) -> Role:
    """The role of task (`task_type`, `task_id`) in `cluster` (``{job: [addresses]}``).

    >>> role({"chief": ["c:1"], "worker": ["w:1", "w:2"]}, "worker", 0)
    Role(is_chief=False, task_type='worker', task_id=0, num_workers=3)
    """
    if not cluster or task_type is None:
        return SINGLE
    workers = max(len(training_tasks(cluster)), 1)
    return Role(is_chief(cluster, task_type, task_id or 0), task_type, task_id, workers)


def strategy_role(strategy: Any) -> Role:
    """The `Role` of this process in `strategy`'s cluster resolver (`SINGLE` without one)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return SINGLE
    return role(resolver.cluster_spec().as_dict(), resolver.task_type, resolver.task_id)


def is_chief(cluster: Mapping[str, Any], task_type: str, task_id: int) -> bool:
    """The chief rule of TensorFlow's `multi_worker_util.is_chief`."""
    if task_type in ("chief", "evaluator"):
        return True
    return "chief" not in cluster and task_type == "worker" and task_id == 0


def training_tasks(cluster: Mapping[str, Any]) -> dict[tuple[str, int], str]:
    """``{(job, index): address}`` of the training tasks, chief first (``{job: {index: address}}`` too)."""
    out: dict[tuple[str, int], str] = {}
    for job in TRAINING_JOBS:
        tasks = cluster.get(job) or []
        for i, address in tasks.items() if isinstance(tasks, dict) else enumerate(tasks):
            out[(job, int(i))] = address
    return out


def killed_when_training_returns(env: Env = None) -> bool:
    """True in a Ray worker: Ray Train kills it once the train function returns, atexit unrun."""
    return "RAY_RAYLET_PID" in (os.environ if env is None else env)


def _error(what: str, received: Any, fix: str) -> ClusterError:
    shown = str(received)
    return ClusterError(f"{what}. Received: {shown[:300]}{'...' * (len(shown) > 300)}. {fix}")


_EXAMPLE = 'Expected e.g. {"cluster": {"worker": ["h0:2222", "h1:2222"]}, "task": {"type": "worker", "index": 0}}'
_MWMS = "not supported by MultiWorkerMirroredStrategy"


def parse_tf_config(raw: str | None, *, env: Env = None) -> ClusterInfo:
    """Reads a TF_CONFIG value (None, "" or "{}": one process); ``env`` tells a Ray worker."""

    def bad(what: str, key: str, value: Any, fix: str) -> ClusterError:
        return _error(f"TF_CONFIG {what}", f"{key}={value!r}", fix)

    if raw is None or not raw.strip():
        return SINGLE_PROCESS
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        what = f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}, char {e.pos})"
        raise bad(what, "TF_CONFIG", raw, _EXAMPLE + "; fix the quoting.") from None
    if not data:
        return SINGLE_PROCESS
    if not isinstance(data, dict):
        raise bad("must be a JSON object", "TF_CONFIG", raw, _EXAMPLE)
    if "sparseCluster" in data:
        fix = "Fix: set `enableDynamicWorker: false`."
        raise bad(f"has `sparseCluster`, {_MWMS}", "sparseCluster", data["sparseCluster"], fix)
    if not isinstance(cluster := data.get("cluster"), dict) or not cluster:
        raise bad("has no `cluster`", "cluster", cluster, _EXAMPLE)
    for job, addresses in cluster.items():
        if job not in (*TRAINING_JOBS, "evaluator", "ps"):
            fix = "Expected chief, worker or evaluator; rename the job."
            raise bad(f"cluster has an unknown job `{job}`", "cluster", cluster, fix)
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            fix = f'Expected "{job}": ["h:2222"].'
            raise bad(f"cluster.{job} must be a list", f"cluster.{job}", addresses, fix)
    if cluster.get("ps"):
        fix = "Fix: remove the PS replicas."
        raise bad(f"cluster has `ps` tasks, which are {_MWMS}", "cluster.ps", cluster["ps"], fix)
    for job in ("chief", "evaluator"):
        if len(cluster.get(job, [])) > 1:
            what = f"cluster.{job} must have at most one task"
            raise bad(what, f"cluster.{job}", cluster[job], "Fix: set `replicas: 1`.")
    if not (tasks := training_tasks(cluster)):
        what = "cluster has no `chief` or `worker` tasks"
        raise bad(what, "cluster", cluster, "Add a worker list.")
    if not isinstance(task := data.get("task"), dict) or "type" not in task:
        fix = 'Expected e.g. "task": {"type": "worker", "index": 0}, its own on each process.'
        raise bad("has no `task`", "task", task, fix)
    task_type, task_id = task["type"], task.get("index")
    if task_type not in (*TRAINING_JOBS, "evaluator"):
        fix = "Expected one of chief, worker, evaluator."
        raise bad("task.type is not a training role", "task.type", task_type, fix)
    if isinstance(task_id, str) and task_id.isdigit():
        task_id = int(task_id)  # TFConfigClusterResolver does int(index) too
    if type(task_id) is not int or task_id < 0:
        what = "task.index must be an integer >= 0"
        raise bad(what, "task.index", task_id, "Fix the task index.")
    count = len(cluster.get(task_type, []))
    if task_id >= count and (task_type != "evaluator" or task_type in cluster):
        what = f"task.index is out of range for `{task_type}` ({count} task(s))"
        raise bad(what, "task", task, f"Expected an index from 0 to {count - 1}.")
    cloud = str(data.get("environment", "")).lower() == "cloud"
    flavor: Literal["kubeflow", "ray", "plain"] = "kubeflow" if cloud else "plain"
    if not cloud and set(cluster) == {"worker"} and killed_when_training_returns(env):
        flavor = "ray"  # Ray Train's TensorflowConfig writes only a worker list
    chief, addresses = is_chief(cluster, task_type, task_id), list(tasks.values())
    return ClusterInfo("tf_config", task_type, task_id, len(tasks), chief, addresses, flavor)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a Slurm hostlist (``n[1-2],m5`` -> n1, n2, m5), keeping order, as TensorFlow does."""
    parts: list[str] = []  # split at commas outside [...], in one pass (linear in the text)
    start, inside = 0, False
    for i, ch in enumerate(hostlist):
        if ch in "[]":
            inside = ch == "["
        elif ch == "," and not inside:
            parts.append(hostlist[start:i])
            start = i + 1
    parts.append(hostlist[start:])
    hosts: list[str] = []
    for part in filter(None, parts):
        m = re.fullmatch(r"([^\[\]]*)(?:\[([^\]]+)\])?", part)
        if m is None or (not m.group(1) and m.group(2) is None):
            raise ValueError(f"bad part {part[:80]!r}")
        prefix, ranges = m.groups()
        if ranges is None:
            hosts.append(prefix)
            continue
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            hosts.extend(prefix + str(i).zfill(len(lo)) for i in range(int(lo), int(hi or lo) + 1))
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expands SLURM_STEP_TASKS_PER_NODE (``3(x2),1`` -> 3, 3, 1)."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"bad part {part!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def slurm_port_base(env: Env = None) -> int:
    """Auto `strategy.slurm.port_base`: one of 1361 (prime) 16-port slots in 10000-31775 per job step."""
    env = os.environ if env is None else env
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "0")
    if not job.isdigit():
        return 8888
    key = int(job) * 16 + (int(step) if step.isdigit() else 0) % 16
    return 10000 + (key % 1361) * 16


def parse_slurm_env(env: Env = None, *, port_base: int | None = None) -> ClusterInfo:
    """Reads a Slurm job step as `SlurmClusterResolver` does: task i of a node at ``port_base`` + i."""
    env = os.environ if env is None else env
    if missing := [v for v in _SLURM_VARS if v not in env]:
        received = f"SLURM_JOB_ID={env.get('SLURM_JOB_ID')!r}"
        fix = "Fix: start it with `srun python train.py`."
        raise _error(f"{', '.join(missing)} are not set", received, fix)
    values = {v: env[v] for v in _SLURM_VARS}
    try:
        rank, num_tasks = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
        hosts = expand_hostlist(env["SLURM_STEP_NODELIST"])
        layout = dict(zip(hosts, expand_tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])))
    except ValueError as e:
        what = f"Slurm variables cannot be read ({e})"
        raise _error(what, values, "Let srun set them.") from None
    base = slurm_port_base(env) if port_base is None else port_base
    addresses = [f"{h}:{base + i}" for h, n in sorted(layout.items()) for i in range(n)]
    if len(addresses) != num_tasks or not 0 <= rank < num_tasks:
        what = "Slurm variables disagree on SLURM_STEP_NUM_TASKS, or SLURM_PROCID is out of range"
        raise _error(what, values, "Run under srun with one task per worker process.")
    return ClusterInfo("slurm", "worker", rank, num_tasks, rank == 0, addresses)


def indexed_job_addresses(hosts: str, port: int, workers: int) -> list[str]:
    """Every worker's ``host:port`` from the pattern ``hosts`` (``{index}``); ``:port`` if it has none."""
    out = [hosts.replace("{index}", str(i)) for i in range(workers)]
    return [h if re.search(r":\d+$", h) else f"{h}:{port}" for h in out]


def parse_indexed_job(hosts: str, port: int, workers: int, env: Env = None) -> ClusterInfo:
    """This pod's place in an Indexed Job or JobSet: worker ``$JOB_COMPLETION_INDEX``, 0 the chief."""
    raw = (os.environ if env is None else env).get(INDEX_VAR)
    if raw is None:
        what = f"strategy.cluster is indexed_job but ${INDEX_VAR} is not set"
        fix = "Kubernetes sets it in an Indexed Job's pods; run there, or set it (0 to workers-1)."
        raise _error(what, f"{INDEX_VAR}=None", fix)
    if not raw.strip().isdigit() or int(raw) >= workers:
        what = f"${INDEX_VAR} is not a worker index from 0 to strategy.indexed_job.workers-1={workers - 1}"
        fix = "Set strategy.indexed_job.workers to the Job's `completions`."
        raise _error(what, f"{INDEX_VAR}={raw!r}", fix)
    index, addresses = int(raw), indexed_job_addresses(hosts, port, workers)
    return ClusterInfo("indexed_job", "worker", index, workers, index == 0, addresses)


class ClusterEnvironment:
    """Where this process sits in one kind of cluster (this base: alone); `keras-sync plan` shows
    ``label``, or ``absent`` when `detect` is False."""

    name, label, absent = "alone", "one process", "one process"
    variable: str | None = None  # the environment variable whose presence `detect`s this cluster

    def __init__(self, strategy_config: Any = None, env: Env = None):
        self.config = strategy_config
        self.env = os.environ if env is None else env

    def detect(self) -> bool:
        return self.variable is None or self.variable in self.env

    def info(self) -> ClusterInfo:
        """This process's place; a `ClusterError` naming what to fix when it is inconsistent."""
        return SINGLE_PROCESS

    def world_size(self) -> int:
        return self.info().num_workers

    def rank(self) -> int:
        return self.info().task_id

    def resolver(self) -> Any:
        """A TensorFlow resolver for `info`'s workers and this machine's GPUs (None: alone)."""
        if self.variable is None:
            return None
        import tensorflow as tf

        info, gpus = self.info(), len(tf.config.list_physical_devices("GPU"))
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"worker": info.worker_addresses}),
            task_type="worker",
            task_id=info.task_id,
            num_accelerators={"GPU": gpus} if gpus else {},
            rpc_layer="grpc",
        )


class TFConfigEnvironment(ClusterEnvironment):
    """``TF_CONFIG``: Kubeflow TFJob, Ray Train, Vertex AI or hand-written."""

    name, label, absent = "tf_config", "TF_CONFIG ({flavor})", "TF_CONFIG unset"

    def detect(self) -> bool:
        return self.info().source != "none"

    def info(self) -> ClusterInfo:
        return parse_tf_config(self.env.get("TF_CONFIG"), env=self.env)


class SlurmEnvironment(ClusterEnvironment):
    """A Slurm job step (``srun``): every task a worker, ports from `strategy.slurm.port_base`."""

    name, label, absent = "slurm", "Slurm", "no Slurm job ($SLURM_PROCID unset)"
    variable = "SLURM_PROCID"

    def port_base(self) -> int:
        base = self.config.slurm.port_base
        return base if isinstance(base, int) else slurm_port_base(self.env)

    def info(self) -> ClusterInfo:
        return parse_slurm_env(self.env, port_base=self.port_base())

    def resolver(self) -> Any:
        self.info()  # its errors say what to fix; TensorFlow's do not
        import tensorflow as tf

        # Without GPUs, TensorFlow's resolver would give each task a GPU that does not exist;
        # with them, it sets CUDA_VISIBLE_DEVICES per task.
        if not tf.config.list_physical_devices("GPU"):
            return super().resolver()
        return tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=self.port_base())


class IndexedJobEnvironment(ClusterEnvironment):
    """A pod of a Kubernetes Indexed Job or JobSet (`strategy.indexed_job`)."""

    name, label, absent = "indexed_job", "Indexed Job", f"no Indexed Job (${INDEX_VAR} unset)"
    variable = INDEX_VAR

    def info(self) -> ClusterInfo:
        job = self.config.indexed_job
        return parse_indexed_job(job.hosts, job.port, job.workers, self.env)


#: The allowed values of `strategy.cluster` (`keras_sync.config` reads the names from here).
CLUSTER_SOURCES: dict[str, type[ClusterEnvironment]] = {
    c.name: c for c in (TFConfigEnvironment, SlurmEnvironment, IndexedJobEnvironment)
}


def read_cluster(strategy_config: Any, env: Env = None) -> tuple[ClusterInfo, str]:
    """This process's place in the cluster `strategy.cluster` names, and where that came from."""
    source = CLUSTER_SOURCES[strategy_config.cluster](strategy_config, env)
    if not source.detect():
        return SINGLE_PROCESS, source.absent
    info = source.info()
    return info, source.label.format(flavor=info.flavor)


def cluster_resolver(strategy_config: Any) -> Any:
    """The TensorFlow cluster resolver for `strategy.cluster` (None: TensorFlow reads TF_CONFIG)."""
    return CLUSTER_SOURCES[strategy_config.cluster](strategy_config).resolver()


# The TF_CONFIG keras_sync built a strategy with: TensorFlow joins one cluster per process.
_recorded: list[str | None] = []


def record_strategy_tf_config(raw: str | None) -> None:
    """Remembers the TF_CONFIG a strategy was built with (called by the strategy factory)."""
    _recorded[:] = [raw]


def _cluster_key(cluster: Any, task_type: Any = None, task_id: Any = None) -> str | None:
    spec = {k: list(v) for k, v in (cluster or {}).items() if v}
    return json.dumps([spec, task_type, task_id], sort_keys=True) if cluster else None


def _tf_config_key(raw: str | None) -> str | None:
    try:
        data = json.loads(raw) if raw and raw.strip() else {}
        task = data.get("task") or {}
        return _cluster_key(data.get("cluster"), task.get("type"), task.get("index"))
    except (ValueError, AttributeError):  # not JSON, or not an object: compared as written
        return raw


def check_tf_config_order(raw: str | None = None, *, env: Env = None) -> None:
    """Raises if TF_CONFIG left the cluster this process joined: TensorFlow ignores it silently."""
    if raw is None:
        raw = (os.environ if env is None else env).get("TF_CONFIG")
    now, received = _tf_config_key(raw), f"TF_CONFIG={raw!r}"
    fix = "Fix: set TF_CONFIG before `keras_sync.load()` and any TensorFlow work, and keep it."
    if _recorded and _tf_config_key(_recorded[0]) != now:
        what = f"TF_CONFIG changed after keras_sync built a strategy here (it was {_recorded[0]!r})"
        raise _error(what, received, fix)
    if "tensorflow" not in sys.modules:
        return
    from keras_sync.upstream.multi_worker import joined_cluster

    joined = joined_cluster()
    if joined is not None and _cluster_key(*joined) != now:
        cluster, job, index = joined
        what = f"TensorFlow in this process already joined the cluster {cluster} as {job}:{index}"
        raise _error(f"{what}, which TF_CONFIG no longer describes", received, fix)
