"""Run a training script as N local workers on 127.0.0.1, each with its own TF_CONFIG (`keras-sync launch`).

A failing worker stops the others (SIGTERM, then SIGKILL after `grace_period_s`: a worker waiting
in a collective ignores SIGTERM); a signal to the launcher is forwarded the same way. Each worker
leads its own session, so no child of a worker outlives the launch but the MLflow courier (its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import IO

from keras_sync.cluster.preemption import exit_code, signal_name
from keras_sync.config import CONFIG_ENV
from keras_sync.errors import KerasSyncError, UsageError

JOB_ID_ENV = "KERAS_SYNC_JOB_ID"  # read by `keras_sync.config` as mlflow.job_id
RESTART_COUNT_ENV = "KERAS_SYNC_RESTART_COUNT"  # the try's number (0, 1, ...), for the workers
_print_lock = threading.Lock()
_FIX = "run launch as root on Linux, or drop --private-network and keep the workers' ports behind a firewall."
Procs = list[subprocess.Popen[bytes]]


def worker_tf_configs(ports: Sequence[int]) -> list[str]:
    """The TF_CONFIG of each local worker: the same cluster, its own index."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    tasks = [{"type": "worker", "index": i} for i in range(len(ports))]
    return [json.dumps({"cluster": cluster, "task": task}) for task in tasks]


def _write(out: IO[str], text: str) -> None:
    with _print_lock, contextlib.suppress(OSError, ValueError):
        out.write(text)  # our output may be gone (`| head`): keep draining
        out.flush()


def _pump(stream: IO[bytes], prefix: str, out: IO[str]) -> None:
    for raw in iter(stream.readline, b""):
        _write(out, prefix + raw.decode("utf-8", errors="replace").rstrip("\n") + "\n")
    stream.close()


def _say(message: str) -> None:
    _write(sys.stderr, f"[launch] {message}\n")


def _invalid(arg: str, got: str, fix: str = _FIX) -> UsageError:
    return UsageError(f"Invalid value for argument `{arg}`. Received: {arg}={got}. Fix: {fix}")


def _signal_groups(procs: Procs, sig: int) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)  # pid == pgid: each worker leads its own session


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
    """`keras-sync launch` (``env``: extra variables); the first failed worker's exit code, or 0."""
    for name, path in (("script", script), ("config", config)):
        if path is not None and not os.path.isfile(path):
            fix = "check the path (relative to the current directory)."
            raise _invalid(name, f"{path!r}, which is not a file", fix)
    base_env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    base_env.update({**(env or {}), "PYTHONUNBUFFERED": "1"})
    # N workers' INFO lines interleaved, unless the environment sets it.
    base_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    if workers > 1 or private_network:
        _refuse_before_start(script, workers, config, base_env, private_network)
    # One job identity for every try: the MLflow run is found again by it (mlflow.job_id).
    base_env.setdefault(JOB_ID_ENV, f"launch-{uuid.uuid4().hex[:12]}")
    if config is not None:
        base_env[CONFIG_ENV] = os.path.abspath(config)
    stop: list[int] = []  # the signal the launcher received
    procs: Procs = []

    def on_signal(signum: int, _frame: object) -> None:
        if stop:  # a second Ctrl-C: no more patience
            _signal_groups(procs, signal.SIGKILL)
        stop.append(signum)

    with contextlib.ExitStack() as stack:
        prefix = stack.enter_context(_private_network()) if private_network else []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                stack.callback(signal.signal, sig, signal.signal(sig, on_signal))
        command = [*prefix, sys.executable, script, *args]
        for attempt in range(max_restarts + 1):
            with _started(command, workers, {**base_env, RESTART_COUNT_ENV: str(attempt)}, procs):
                code, failed = _supervise(procs, stop, grace_period_s)
            if code == 0 or stop or failed is None or attempt == max_restarts:
                break
            _say(
                f"restart {attempt + 1}/{max_restarts} after worker {failed} exited with code {code}"
            )
    return code


def _refuse_before_start(
    script: str, workers: int, config: str | None, environ: dict[str, str], private: bool
) -> None:
    """A one-process kind under several workers, or an HTTP tracking store in a namespace."""
    from keras_sync.config import load_config
    from keras_sync.strategy import refuse_one_process_kind
    from keras_sync.tracking.redact import redact_uri

    try:
        cfg = load_config(config, environ=environ)
    except KerasSyncError:
        return  # every worker reports it
    started = f"keras-sync launch --workers {workers} starts {workers} workers"
    refuse_one_process_kind(cfg, workers, started, f"run it as one process: python {script}")
    uri = cfg.mlflow.tracking_uri or ""
    if private and cfg.mlflow.enabled and uri.lower().startswith(("http://", "https://")):
        why = f"with mlflow.tracking_uri={redact_uri(uri)!r}, which the namespace cannot reach"
        fix = "use a sqlite or file store, set mlflow.enabled: false, or drop --private-network."
        raise _invalid("private_network", f"True {why}", fix)


@contextlib.contextmanager
def _started(command: list[str], workers: int, env: dict[str, str], procs: Procs) -> Iterator[None]:
    """The workers in ``procs``, on fresh ports, their output prefixed; all killed at the end."""
    with contextlib.ExitStack() as held:  # every port held until all are chosen: they differ
        socks = [held.enter_context(socket.socket()) for _ in range(workers)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        configs = worker_tf_configs([s.getsockname()[1] for s in socks])
    procs.clear()
    pumps: list[threading.Thread] = []
    try:
        for i, tf_config in enumerate(configs):
            p = subprocess.Popen(
                command,
                env={**env, "TF_CONFIG": tf_config},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            procs.append(p)
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                pump = threading.Thread(target=_pump, args=(stream, f"[w{i}] ", out), daemon=True)
                pump.start()
                pumps.append(pump)
        yield
    finally:
        _signal_groups(procs, signal.SIGKILL)  # what workers left behind, or a crash here
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=2.0)


def _supervise(procs: Procs, stop: list[int], grace_period_s: float) -> tuple[int, int | None]:
    """Waits for the workers; on a failure or a signal, stops them all: (exit code, failed worker)."""
    result: int | None = None
    failed_worker: int | None = None
    kill_at = float("inf")
    while True:
        codes = [p.poll() for p in procs]
        if result is None and stop:
            result, name = exit_code(stop[0]), signal_name(stop[0])  # only SIGINT, SIGTERM come
            again = "; Ctrl-C again to kill them at once" if name == "Ctrl-C" else ""
            _say(f"{name}: stopping {len(procs)} worker(s){again}")
            _signal_groups(procs, stop[0])
            kill_at = time.monotonic() + grace_period_s
        # A shell-style exit code: a death by signal N becomes 128 + N.
        failed = [(i, 128 - c if c < 0 else c) for i, c in enumerate(codes) if c not in (None, 0)]
        if result is None and failed:
            # Every failed worker is named: the others may have ended between two polls.
            (failed_worker, result), running = failed[0], codes.count(None)
            said = [f"w{failed_worker} exited with code {result}"]
            said += [f"w{j} exited too, with code {c}" for j, c in failed[1:]]
            _say("; ".join(said + ([f"stopping the other {running} worker(s)"] if running else [])))
            if running:
                _signal_groups(procs, signal.SIGTERM)
                kill_at = time.monotonic() + grace_period_s
        if None not in codes:
            return (0, None) if result is None else (result, failed_worker)
        if time.monotonic() >= kill_at:
            _say(f"worker(s) still running after {grace_period_s:g} s; sending SIGKILL")
            _signal_groups(procs, signal.SIGKILL)
            kill_at = float("inf")
        time.sleep(0.05)


# Brings `lo` up (SIOCGIFFLAGS/SIOCSIFFLAGS, no `ip` binary needed), says so, then holds the
# namespace until its stdin (the launcher's pipe) closes: a launcher killed with SIGKILL leaves nothing.
_HOLDER = (
    "import fcntl, socket, struct, sys\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "flags = struct.unpack('16sH14x', fcntl.ioctl(s, 0x8913, struct.pack('16sH14x', b'lo', 0)))[1]\n"
    "fcntl.ioctl(s, 0x8914, struct.pack('16sH14x', b'lo', flags | 1))\n"
    "print('ready', flush=True)\n"
    "sys.stdin.buffer.read()\n"
)


def refuse_private_network_unless_possible() -> None:
    """Say in one line why ``--private-network`` cannot work here (not Linux, not root, no util-linux)."""
    missing = " and ".join(tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None)
    if not sys.platform.startswith("linux"):
        why = f"network namespaces are Linux only (this is {sys.platform})"
    elif os.geteuid() != 0:
        why = f"a network namespace needs root or CAP_SYS_ADMIN (uid {os.geteuid()})"
    elif missing:
        why = f"{missing} (util-linux) not found on the PATH"
    else:
        return
    raise _invalid("private_network", f"True, but {why}")


@contextlib.contextmanager
def _private_network() -> Iterator[list[str]]:
    """A network namespace with only a loopback; yields the prefix that runs a command in it."""
    refuse_private_network_unless_possible()
    holder = subprocess.Popen(
        ["unshare", "--net", "--", sys.executable, "-c", _HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    with holder:  # the namespace goes with the last process in it
        try:
            assert holder.stdout is not None
            if holder.stdout.readline().strip() != b"ready":
                why = f"True, but `unshare --net` failed (exit code {holder.wait()}; said above)"
                fix = "drop --private-network, or allow network namespaces here (CAP_SYS_ADMIN)."
                raise _invalid("private_network", why, fix)
            yield ["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--"]
        finally:
            holder.kill()
