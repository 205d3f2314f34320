"""Shared fixtures: a real `mlflow server` on 127.0.0.1 that tests can stop and restart; `tmp_module`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _ports import free_ports

ROOT = Path(__file__).resolve().parents[1]


_WHERE = (
    "import importlib.util as u, sys\n"
    "for m in ('keras_sync', 'keras_sync.templates'):\n"
    "    print(list(u.find_spec(m).submodule_search_locations)[0])"
)


def _one_keras_sync_for_every_process() -> None:
    """Stop the suite when its subprocesses would import another keras-sync than the tests do.

    An editable install maps `keras_sync` (and `keras_sync.templates`, shipped from `templates/`) to
    the checkout it was installed from. Run from a second clone with the first one's venv
    (`python -m pytest` puts the clone first on the test process's path), the subprocesses (the
    `keras-sync` console script, scenario scripts) would silently run the other checkout's code and
    templates. The CI lanes test an installed (non-editable) package: the same check holds there.
    """
    import importlib.util

    here = [
        str(Path(list(importlib.util.find_spec(m).submodule_search_locations)[0]).resolve())
        for m in ("keras_sync", "keras_sync.templates")
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    child = subprocess.run(
        [sys.executable, "-c", _WHERE], cwd="/", env=env, capture_output=True, text=True, timeout=60
    )
    there = [str(Path(line).resolve()) for line in child.stdout.split()]
    if here != there:
        pytest.exit(
            f"tests of {ROOT} import keras_sync from {here[0]} but their subprocesses would import "
            f"{there or child.stderr.strip()[-200:]}: install this checkout into the venv that runs them: "
            f"{sys.executable} -m pip install -e '{ROOT}[cpu,test]'",
            returncode=4,
        )


_one_keras_sync_for_every_process()

# A shell without job control starts a background job (`pytest ... &`, `( ... ) &` in a script) with
# SIGINT ignored, and every process the suite starts would inherit that: the Ctrl-C tests need
# Python's own handler, whatever started the suite.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Every process the suite starts (scenario scripts, workers, couriers, the CLI, mlflow server) runs
# tests/_lean_site/sitecustomize.py first: Keras then does not import scikit-learn, pandas and matplotlib, ~2
# of the ~6 CPU-s each TensorFlow process spends starting (its docstring tells why that is safe). The pytest
# process itself the same, for the tests that import Keras here.
LEAN_SITE = Path(__file__).resolve().parent / "_lean_site"
if str(LEAN_SITE) not in os.environ.get("PYTHONPATH", "").split(
    os.pathsep
):  # xdist's workers: there already
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(LEAN_SITE), os.environ.get("PYTHONPATH")) if p
    )
if not any(
    type(f).__name__ == "_NotForKeras" for f in sys.meta_path
):  # this process too (started before PYTHONPATH)
    import importlib.util as _util

    _spec = _util.spec_from_file_location("_keras_sync_lean_site", LEAN_SITE / "sitecustomize.py")
    sys.modules[_spec.name] = _util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_spec.name])


def _start_zygotes() -> None:
    """Processes that import TensorFlow and Keras (two) or MLflow (one, for couriers) once, to fork from.

    tests/_lean_site/_zygote.py tells how and when (~4.6 CPU-s saved per TensorFlow process, ~200 of
    them; ~2.5 per courier, ~80). Started once per run (xdist's workers inherit the variable), with TF_CPP_MIN_LOG_LEVEL=2 as
    nearly every test starts its scripts (a process whose import-time environment differs runs as
    usual). They exit when this process does (the pipe's write end closes).
    KERAS_SYNC_TEST_ZYGOTE= (empty) before pytest runs the suite without them.
    """
    if _ZYGOTE_VAR in os.environ:
        return
    import atexit
    import shutil
    import tempfile

    sys.path.insert(0, str(LEAN_SITE))
    try:
        import _zygote
    finally:
        sys.path.remove(str(LEAN_SITE))
    where = tempfile.mkdtemp(prefix="ks-zygote-")
    started = _zygote.start(where, TF_CPP_MIN_LOG_LEVEL="2")

    def stop() -> None:
        for _proc, control in started:
            os.close(control)
        for proc, _ in started:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if not os.environ.get(
            "KERAS_SYNC_TEST_PROCS"
        ):  # kept with the process log: which scripts it started
            shutil.rmtree(where, ignore_errors=True)

    atexit.register(stop)
    os.environ[_ZYGOTE_VAR] = where


_ZYGOTE_VAR = "KERAS_SYNC_TEST_ZYGOTE"
_start_zygotes()


class MlflowServer:
    """A real `mlflow server` (sqlite store, one worker) that keeps its port and store across restarts."""

    def __init__(self, root: Path, port: int | None = None):
        self.root = root
        self.port = port or free_ports(1)[0]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.store_uri = f"sqlite:///{root / 'db'}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = root / "server.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(
        self, timeout_s: float = 300.0
    ) -> None:  # ~6 s alone; 105 s seen with 8 test runs on 2 cores
        """Start the server and wait until /health answers."""
        if self.running:
            return
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        env.pop("MLFLOW_TRACKING_URI", None)
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            self.store_uri,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        with open(self._log, "ab") as log:
            # Own process group: `mlflow server` runs uvicorn as a child, and a stop must end both.
            self._proc = subprocess.Popen(
                cmd,
                cwd=self.root,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with {self._proc.returncode}; see {self._log}"
                )
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"mlflow server not healthy after {timeout_s} s; see {self._log}")

    def stop(self) -> None:
        """Kill the server (SIGKILL to its process group), as a crash would."""
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait(timeout=30)
        self._proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


# Modules that share a session fixture run in one pytest-xdist group (the fixture then runs once).
_XDIST_GROUPS = {"test_model_logging": "autolog_runs", "test_sync_report": "autolog_runs"}

# The modules that take longest, longest first: seconds of a serial full run on the 2-core CI machine
# (`--durations`, 2026-12-02). Under `pytest -n 2` each worker takes the next whole module when it
# is free (`--dist loadgroup --no-loadscope-reorder` in pyproject.toml), so starting with the longest
# keeps one long module from running alone at the end while the other worker is idle. The numbers
# only order: a module missing here runs after these, in collection order. Re-measure when a
# module's fixture grows (`pytest -q --durations=0`, summed per module). On a shared machine the
# wall clock follows the load (the same module took 2-5x longer at load 10-30), so compare a
# change by the CPU time of the module alone (`/usr/bin/time` user+sys of the pytest process,
# which counts the scenario processes it waits for), before and after side by side. 2026-12-03:
# test_keras_compat is the 12-02 figure scaled by its CPU ratio after/before (0.94); test_tracking
# lost its busy-core test's measured saving (25 s of 63 s at load 20, halved to this scale).
_LONGEST_FIRST = {
    "test_tracking": 628,
    "test_multi_worker": 300,
    "test_own_fit": 240,
    "test_ray": 216,
    "autolog_runs": 212,
    "test_runtime": 191,
    "test_keras_compat": 148,
    "test_backup_faults": 150,
    "test_epoch": 135,
    "test_sync_metrics": 149,
    "test_pipeline": 137,
    "test_preemption": 115,
    "test_slurm": 114,
    "test_two_hosts": 112,
    "test_launch": 91,
    "test_collective_calls": 72,
    "test_examples": 67,
    "test_cli": 61,
    "test_session": 45,
    "test_saving": 49,
    "test_cluster": 43,
    "test_resume": 34,
    "test_sqlite_store": 33,
    "test_fit_ends_run": 300,
    "test_weight_divergence": 28,
    "test_system_metrics": 25,
    "test_user_callbacks": 40,
    "test_verify": 194,
    "test_flaky_server": 110,
}


def _group_of(nodeid: str) -> str:
    """The unit of work of a test: its module's name, or the `_XDIST_GROUPS` group it shares."""
    module = nodeid.split("::", 1)[0].rpartition("/")[2].removesuffix(".py")
    return _XDIST_GROUPS.get(module, module)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadgroup` (pyproject.toml) here means: one worker runs a whole module (or group).

    Module fixtures (one TensorFlow process group per module: the expensive part) then run once,
    and the modules that share `autolog_runs` stay together. pytest-xdist's own loadgroup reads
    the groups from a suffix it writes into each item's node id; pytest 9.2 no longer lets it do
    that (node ids moved from `_nodeid` to `_id`), and every test was then scheduled on its own,
    each module's fixture running on both workers. A scope per module from the node id's file
    name does not depend on that.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first (`_LONGEST_FIRST`); tests keep their order within a module."""
    items.sort(key=lambda item: -_LONGEST_FIRST.get(_group_of(item.nodeid), 0))


# Variables keras-sync reads over its YAML (or TensorFlow reads for the cluster): a test that leaves
# one changed in the pytest process silently redirects every later test's training subprocess
# (MLflow 3's `set_tracking_uri` writes MLFLOW_TRACKING_URI; CI lost 3 tests to that once).
_GUARDED_ENV = (
    "MLFLOW_TRACKING_URI",
    "TF_CONFIG",
    "KERAS_SYNC_CONFIG",
    "KERAS_SYNC_JOB_ID",
    "CUDA_VISIBLE_DEVICES",
)


@pytest.fixture(autouse=True)
def _environment_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test that changes a guarded variable in this process, and put the value back."""
    before = {k: os.environ.get(k) for k in _GUARDED_ENV}
    yield
    after = {k: os.environ.get(k) for k in _GUARDED_ENV}
    changed = {k: (before[k], after[k]) for k in _GUARDED_ENV if before[k] != after[k]}
    for k, (old, _) in changed.items():
        if old is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = old
    if changed:
        pytest.fail(
            f"{request.node.nodeid} left the pytest process's environment changed (before, after): "
            f"{changed}; use monkeypatch.setenv/delenv",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def mlflow_server_control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """The `MlflowServer` handle (uri, start, stop, restart), started; killed at session end."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mlflow_server(mlflow_server_control: MlflowServer) -> str:
    """URI of a running real `mlflow server` shared by the session."""
    mlflow_server_control.start()
    return mlflow_server_control.uri


@pytest.fixture
def restartable_mlflow_server(mlflow_server_control: MlflowServer) -> Iterator[MlflowServer]:
    """The shared server for a test that stops it; it is running again when the test ends."""
    mlflow_server_control.start()
    try:
        yield mlflow_server_control
    finally:
        mlflow_server_control.start()


@pytest.fixture(scope="module")
def tmp_module(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary directory shared by the tests of one module (their reference runs, their stores)."""
    return tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])


@pytest.fixture(scope="session")
def autolog_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The runs of tests/_autolog_scenarios.py (model logging, sync report, autolog beside keras-sync).

    Two TensorFlow process groups started together, shared by test_model_logging.py and
    test_sync_report.py: 2 simulated replicas, and 2 MWMS workers, each to its own sqlite store.
    Returns their result dicts, output directory and tracking URIs.
    """
    import json

    out = tmp_path_factory.mktemp("autolog")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for k in ("TF_CONFIG", "MLFLOW_TRACKING_URI", "KERAS_SYNC_JOB_ID", "KERAS_SYNC_CONFIG"):
        env.pop(k, None)
    script = str(Path(__file__).parent / "_autolog_scenarios.py")
    sqlite_uri = f"sqlite:///{out / 'mlflow.db'}"
    mw_dir = out / "mw"
    mw_dir.mkdir()
    (mw_dir / "mw.yaml").write_text(
        "strategy: {kind: multi_worker_mirrored, connect_timeout_s: 300}\n"
        "batch: {global: 64}\n"
        "mlflow:\n"
        f"  tracking_uri: sqlite:///{mw_dir / 'mlflow.db'}\n"
        "  experiment: mw-model\n"
        "  log_model: true\n"
    )
    procs = {
        "mirrored": subprocess.Popen(
            [sys.executable, script, "mirrored", str(out), sqlite_uri],
            cwd=out,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        "multi_worker": subprocess.Popen(
            [
                sys.executable,
                "-m",
                "keras_sync.launch",
                "--workers",
                "2",
                script,
                "multi_worker",
                str(out),
                str(mw_dir / "mw.yaml"),
            ],
            cwd=mw_dir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
    }
    logs = {}
    for name, proc in procs.items():
        logs[name], _ = proc.communicate(timeout=1500)
        assert proc.returncode == 0, f"{name} scenario failed:\n{logs[name][-5000:]}"
    return {
        "mirrored": json.loads((out / "mirrored.json").read_text()),
        "multi_worker": json.loads((out / "multi_worker.json").read_text()),
        "out": out,
        "mw_dir": mw_dir,
        "sqlite": sqlite_uri,
        "mw_sqlite": f"sqlite:///{mw_dir / 'mlflow.db'}",
        "logs": logs,
    }


# CPU seconds per test, the figure to compare a speed change by on a shared machine (the wall clock
# follows the load): KERAS_SYNC_TEST_CPU=FILE appends one line per test, "<user+sys s> test <node id>
# <xdist worker> <wall start> <wall end>" (unix seconds: which worker was busy when), counting this
# process and the children it waited for (a scenario's TensorFlow process; not an orphaned courier).
# Scenario scripts add "<cpu s> case <script>:<case> <mode> <unix s>" per recorded case (tests/_scenario.py).
# `sort -rn FILE | head` lists the costliest.
_CPU_LOG = os.environ.get("KERAS_SYNC_TEST_CPU")


def _cpu_now() -> float:
    import resource

    return sum(
        u.ru_utime + u.ru_stime
        for u in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _CPU_LOG:
        yield
        return
    start, began = _cpu_now(), time.time()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
    with open(_CPU_LOG, "a") as fh:
        fh.write(
            f"{_cpu_now() - start:.1f} test {item.nodeid} {worker} {began:.1f} {time.time():.1f}\n"
        )
