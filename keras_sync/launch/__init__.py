"""Run a training script as N local workers on 127.0.0.1, each with its own TF_CONFIG.

    keras-sync launch --workers 2 [--config FILE] [--max-restarts N] train.py [ARGS...]
    python -m keras_sync.launch ...             (the same command line)

Each worker runs `sys.executable SCRIPT ARGS` in its own session (its own process group), with
`TF_CONFIG` naming all workers on free ports of 127.0.0.1, `KERAS_SYNC_CONFIG` set to the config
file if given, and `PYTHONUNBUFFERED=1`. Output lines come back prefixed `[w0]`, `[w1]`, ...

Stopping: when a worker exits non-zero the others get SIGTERM and, after `grace_period_s`, SIGKILL
(a worker waiting in a collective for a dead peer ignores SIGTERM). Ctrl-C or SIGTERM to the
launcher is forwarded the same way; a second one kills at once. At the end every worker's process
group is killed, so no child a worker started outlives the launch.

Restarts: with `max_restarts` N > 0 a failed try is followed by a new try of the whole job on fresh
ports, up to N times. Every try has the same `KERAS_SYNC_JOB_ID`, so a job with a backup resumes
and continues its one MLflow run; `KERAS_SYNC_RESTART_COUNT` tells the workers which try they are
in (as torchrun's `TORCHELASTIC_RESTART_COUNT`). A signal to the launcher is never followed by a
restart.

Exposure: TensorFlow's gRPC server listens on 0.0.0.0 whatever TF_CONFIG says, so other hosts can
reach the workers' ports; `private_network` runs them in a network namespace of their own
(`keras_sync.cluster.netns`). Ports are found by binding 127.0.0.1:0 and closed just before the
workers start, so another process could take one in between (the launch then fails; rerun).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import IO

from keras_sync.config import CONFIG_ENV
from keras_sync.errors import UsageError

JOB_ID_ENV = "KERAS_SYNC_JOB_ID"  # read by `keras_sync.config` as mlflow.job_id
RESTART_COUNT_ENV = "KERAS_SYNC_RESTART_COUNT"  # the try's number (0, 1, ...), for the workers; keras-sync reads none

_POLL_S = 0.05
_print_lock = threading.Lock()


def _reserve_ports(n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        socks.append(s)  # kept open until launch so the n ports are distinct
    return socks


def worker_tf_configs(ports: Sequence[int]) -> list[str]:
    """The TF_CONFIG of each local worker: the same cluster, its own index."""
    workers = [f"127.0.0.1:{p}" for p in ports]
    return [
        json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})
        for i in range(len(workers))
    ]


def _pump(stream: IO[bytes], prefix: str, out: IO[str]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if not line.endswith("\n"):
            line += "\n"
        with _print_lock:
            try:
                out.write(prefix + line)
                out.flush()
            except (OSError, ValueError):
                pass  # our output is gone (`| head`, closed stream): keep draining so the worker never blocks
    stream.close()


def _say(message: str) -> None:
    with _print_lock:
        sys.stderr.write(f"[launch] {message}\n")
        sys.stderr.flush()


def _signal_groups(procs: Sequence[subprocess.Popen[bytes]], sig: int) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, sig)  # pid == pgid: each worker leads its own session
        except (ProcessLookupError, PermissionError):
            pass


def _exit_code(returncode: int) -> int:
    """A shell-style exit code: a death by signal N becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _validate(
    script: str, workers: object, config: str | None, grace_period_s: float, max_restarts: object
) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UsageError(
            f"Invalid value for argument `workers`. Received: workers={workers!r}. "
            "Expected an integer >= 1. Fix: pass e.g. --workers 2."
        )
    if not os.path.isfile(script):
        raise UsageError(
            f"Invalid value for argument `script`. Received: script={script!r}, which is not a file. "
            "Expected the path of a Python training script. Fix: check the path (relative to the current directory)."
        )
    if config is not None and not os.path.isfile(config):
        raise UsageError(
            f"Invalid value for argument `config`. Received: config={config!r}, which is not a file. "
            "Expected the path of a keras-sync YAML file. Fix: check the path, or run `keras-sync init`."
        )
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise UsageError(
            f"Invalid value for argument `max_restarts`. Received: max_restarts={max_restarts!r}. "
            "Expected an integer >= 0 (0 = no restart). Fix: pass e.g. --max-restarts 3."
        )
    if grace_period_s < 0:
        raise UsageError(
            f"Invalid value for argument `grace_period_s`. Received: grace_period_s={grace_period_s!r}. "
            "Expected a number of seconds >= 0."
        )


def _refuse_config(
    script: str, workers: int, config: str | None, environ: Mapping[str, str], private: bool
) -> None:
    """Refuse, before any worker starts, what the workers' config cannot do here: a one-process
    kind (`mirrored`, ...) under several workers (as many jobs), or an HTTP tracking server under
    ``private_network`` (unreachable from the namespace).

    Reads the config by `keras_sync.load()`'s rule (``config``, else ``$KERAS_SYNC_CONFIG``, else
    ``./keras_sync.yaml``); a config that does not load is left to the workers' own `load`.
    """
    from keras_sync.config import load_config
    from keras_sync.errors import KerasSyncError

    if workers <= 1 and not private:
        return
    try:
        cfg = load_config(config, environ=environ)
    except KerasSyncError:
        return
    if workers > 1:
        from keras_sync.strategy import refuse_one_process_kind
        from keras_sync.tracking.shell_hint import python_command

        refuse_one_process_kind(
            cfg,
            workers,
            f"keras-sync launch --workers {workers} starts {workers} workers",
            f"run it as one process: {python_command()} {script}",
        )
    uri = cfg.mlflow.tracking_uri or ""
    if private and cfg.mlflow.enabled and uri.lower().startswith(("http://", "https://")):
        from keras_sync.tracking.redact import redact_uri

        raise UsageError(
            f"Invalid value for argument `private_network`. Received: private_network=True with mlflow.tracking_uri="
            f"{redact_uri(uri)!r}: in their own network namespace the workers reach no network but their loopback, "
            "so not that server. Fix: use a sqlite or file store (e.g. sqlite:///mlflow.db) and deliver it later, set "
            "mlflow.enabled: false, or drop --private-network and keep the ports behind a firewall."
        )


def launch(
    script: str,
    args: list[str],
    *,
    workers: int,
    config: str | None = None,
    grace_period_s: float = 5.0,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    private_network: bool = False,
) -> int:
    """Runs `script` as `workers` local processes; returns the job's exit code.

    Args:
        script: path of the Python script every worker runs.
        args: arguments passed to the script.
        workers: number of worker processes (>= 1).
        config: keras-sync YAML file, passed to workers as `KERAS_SYNC_CONFIG`.
        grace_period_s: time between SIGTERM (or a forwarded SIGINT) and SIGKILL.
        max_restarts: when a worker fails, stop the others and start the whole job again, up
            to this many times (0: stop). Every try has the same `KERAS_SYNC_JOB_ID`, so a job
            with a backup resumes and continues its MLflow run.
        env: extra environment variables for the workers, on top of `os.environ`.
        private_network: run the workers in a network namespace of their own, so no other host
            can reach their ports (TensorFlow's servers listen on every interface and run what a
            client sends); Linux as root, and the workers reach no network but their loopback
            (`keras_sync.cluster.netns`).

    Returns:
        0 if every worker of a try exits 0; else the exit code of the first worker that
        failed in the last try (128 + N for a death by signal N); 130 after Ctrl-C, 143 after SIGTERM.

    Raises:
        UsageError: a bad argument (workers < 1, a missing script or config), a config whose
            strategy kind runs in one process (`mirrored`, ...) under several workers, or
            ``private_network`` where no network namespace can be made.
    """
    _validate(script, workers, config, grace_period_s, max_restarts)
    _refuse_config(script, workers, config, {**os.environ, **(env or {})}, private_network)
    base_env = dict(os.environ)
    base_env.pop("TF_CONFIG", None)
    base_env.update(env or {})
    base_env["PYTHONUNBUFFERED"] = "1"
    # One job identity for every try: the MLflow run is found again by it (mlflow.job_id; a restored
    # backup's recorded run wins, see training/job_run.py).
    base_env.setdefault(JOB_ID_ENV, f"launch-{uuid.uuid4().hex[:12]}")
    if config is not None:
        base_env[CONFIG_ENV] = os.path.abspath(config)

    stop: dict[str, int] = {}  # "signal" -> the signal the launcher received
    procs: list[subprocess.Popen[bytes]] = []

    def on_signal(signum: int, _frame: object) -> None:
        if "signal" in stop:  # a second Ctrl-C: no more patience
            _signal_groups(procs, signal.SIGKILL)
        stop.setdefault("signal", signum)

    previous: dict[int, object] = {}
    network = None
    if private_network:
        from keras_sync.cluster.netns import PrivateNetwork

        network = PrivateNetwork()
    wrap = network.wrap if network is not None else list
    try:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, on_signal)
        for attempt in range(max_restarts + 1):
            try_env = {**base_env, RESTART_COUNT_ENV: str(attempt)}
            code, failed = _one_try(
                wrap([sys.executable, script, *args]), workers, try_env, procs, stop, grace_period_s
            )
            if code == 0 or "signal" in stop or failed is None or attempt == max_restarts:
                return code
            _say(
                f"restart {attempt + 1}/{max_restarts} after worker {failed} exited with code {code}"
            )
        return code  # pragma: no cover - the loop always returns
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        if network is not None:
            network.close()


def _one_try(
    command: list[str],
    workers: int,
    base_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
    stop: dict[str, int],
    grace_period_s: float,
) -> tuple[int, int | None]:
    """Starts the workers on fresh ports and supervises them: (exit code, index of the failed worker)."""
    procs.clear()
    pumps: list[threading.Thread] = []
    socks: list[socket.socket] = []
    try:
        socks = _reserve_ports(workers)
        configs = worker_tf_configs([s.getsockname()[1] for s in socks])
        for s in socks:
            s.close()
        for i, tf_config in enumerate(configs):
            p = subprocess.Popen(
                command,
                env={**base_env, "TF_CONFIG": tf_config},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            procs.append(p)
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, f"[w{i}] ", out), daemon=True)
                t.start()
                pumps.append(t)
        return _supervise(procs, stop, grace_period_s)
    finally:
        for s in socks:
            s.close()
        # leftovers of workers that exited, or of a crash here
        _signal_groups(procs, signal.SIGKILL)
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=2.0)


def _supervise(
    procs: list[subprocess.Popen[bytes]], stop: dict[str, int], grace_period_s: float
) -> tuple[int, int | None]:
    """Waits for the workers; on a failure or a signal, stops them all: (exit code, failed worker)."""
    result: int | None = None
    failed_worker: int | None = None
    kill_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if result is None and "signal" in stop:
            sig = stop["signal"]
            result = 128 + sig
            if sig == signal.SIGINT:
                _say(f"Ctrl-C: stopping {len(procs)} worker(s); Ctrl-C again to kill them at once")
            else:
                _say(f"got {signal.Signals(sig).name}; stopping {len(procs)} worker(s)")
            _signal_groups(procs, sig)
            kill_at = time.monotonic() + grace_period_s
        if result is None:
            failed = next(((i, c) for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                i, code = failed
                result, failed_worker = _exit_code(code), i
                running = sum(c is None for c in codes)
                # Said even when no worker is left: the others may have ended between two polls
                # (a peer that lost its chief ends within seconds; seen under load in CI).
                others = [
                    f"w{j} exited too, with code {_exit_code(c)}"
                    for j, c in enumerate(codes)
                    if j != i and c not in (None, 0)
                ]
                _say(
                    "; ".join(
                        [f"w{i} exited with code {result}", *others]
                        + ([f"stopping the other {running} worker(s)"] if running else [])
                    )
                )
                if running:
                    _signal_groups(procs, signal.SIGTERM)
                    kill_at = time.monotonic() + grace_period_s
        if all(c is not None for c in codes):
            return (result, failed_worker) if result is not None else (0, None)
        if kill_at is not None and time.monotonic() >= kill_at:
            _say(f"worker(s) still running after {grace_period_s:g} s; sending SIGKILL")
            _signal_groups(procs, signal.SIGKILL)
            kill_at = float("inf")
        time.sleep(_POLL_S)
