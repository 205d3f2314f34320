"""Run a training script as N local workers on 127.0.0.1, each with its own TF_CONFIG.

    python -m keras_sync.launch --workers 2 [--config FILE] train.py [ARGS...]

Each worker runs `sys.executable SCRIPT ARGS` in its own session (so its own
process group), with `TF_CONFIG` naming all workers on free ports of 127.0.0.1,
`KERAS_SYNC_CONFIG` set to the config file if given, and `PYTHONUNBUFFERED=1`.
Output lines come back prefixed `[w0]`, `[w1]`, ...

Stopping: when a worker exits non-zero the others get SIGTERM and, after
`grace_period_s`, SIGKILL (a worker waiting in a collective for a dead peer
ignores SIGTERM and SIGINT). Ctrl-C (SIGINT) or SIGTERM to the launcher is
forwarded to every worker with the same escalation. At the end every worker's
process group is killed, so no child a worker started outlives the launch
(unless it left the group with setsid). A launcher killed with SIGKILL cannot
clean up; its workers then lose their output pipes, and the next line a worker
prints fails (EPIPE), which ends a Python worker.

Ports: free ports are found by binding 127.0.0.1:0; the sockets are closed just
before the workers start, so another process could take a port in that short
window (the worker then fails to start its server and the launch fails; rerun).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, NoReturn

from keras_sync.errors import KerasSyncError, UsageError

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


def _validate(script: str, workers: object, config: str | None, grace_period_s: float) -> None:
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
    if grace_period_s < 0:
        raise UsageError(
            f"Invalid value for argument `grace_period_s`. Received: grace_period_s={grace_period_s!r}. "
            "Expected a number of seconds >= 0."
        )


def launch(
    script: str,
    args: list[str],
    *,
    workers: int,
    config: str | None = None,
    grace_period_s: float = 5.0,
    env: Mapping[str, str] | None = None,
) -> int:
    """Runs `script` as `workers` local processes; returns the job's exit code.

    Args:
        script: path of the Python script every worker runs.
        args: arguments passed to the script.
        workers: number of worker processes (>= 1).
        config: keras-sync YAML file, passed to workers as `KERAS_SYNC_CONFIG`.
        grace_period_s: time between SIGTERM (or a forwarded SIGINT) and SIGKILL.
        env: extra environment variables for the workers, on top of `os.environ`.

    Returns:
        0 if every worker exits 0; else the exit code of the first worker that
        failed (128 + N for a death by signal N); 130 after Ctrl-C, 143 after SIGTERM.

    Raises:
        UsageError: a bad argument (workers < 1, a missing script or config).
    """
    _validate(script, workers, config, grace_period_s)
    base_env = dict(os.environ)
    base_env.pop("TF_CONFIG", None)
    base_env.update(env or {})
    base_env["PYTHONUNBUFFERED"] = "1"
    if config is not None:
        base_env["KERAS_SYNC_CONFIG"] = os.path.abspath(config)

    stop: dict[str, int] = {}  # "signal" -> the signal the launcher received
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []

    def on_signal(signum: int, _frame: object) -> None:
        if "signal" in stop:  # a second Ctrl-C: no more patience
            _signal_groups(procs, signal.SIGKILL)
        stop.setdefault("signal", signum)

    previous: dict[int, object] = {}
    socks: list[socket.socket] = []
    try:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, on_signal)
        socks = _reserve_ports(workers)
        configs = worker_tf_configs([s.getsockname()[1] for s in socks])
        for s in socks:
            s.close()
        for i, tf_config in enumerate(configs):
            p = subprocess.Popen(
                [sys.executable, script, *args],
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
        _signal_groups(procs, signal.SIGKILL)  # leftovers of workers that exited, or of a crash here
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=2.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _supervise(procs: list[subprocess.Popen[bytes]], stop: dict[str, int], grace_period_s: float) -> int:
    """Waits for the workers; on a failure or a signal, stops them all. Returns the exit code."""
    result: int | None = None
    kill_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if result is None and "signal" in stop:
            sig = stop["signal"]
            result = 128 + sig
            _say(f"got {signal.Signals(sig).name}; stopping {len(procs)} worker(s)")
            _signal_groups(procs, sig)
            kill_at = time.monotonic() + grace_period_s
        if result is None:
            failed = next(((i, c) for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                i, code = failed
                result = _exit_code(code)
                running = sum(c is None for c in codes)
                if running:
                    _say(f"w{i} exited with code {result}; stopping the other {running} worker(s)")
                    _signal_groups(procs, signal.SIGTERM)
                    kill_at = time.monotonic() + grace_period_s
        if all(c is not None for c in codes):
            return result if result is not None else 0
        if kill_at is not None and time.monotonic() >= kill_at:
            _say(f"worker(s) still running after {grace_period_s:g} s; sending SIGKILL")
            _signal_groups(procs, signal.SIGKILL)
            kill_at = float("inf")
        time.sleep(_POLL_S)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; expected an integer >= 1, e.g. --workers 2")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m keras_sync.launch`."""
    parser = _Parser(
        prog="python -m keras_sync.launch",
        description="Run a training script as N local workers on 127.0.0.1 with TF_CONFIG set for each.",
    )
    parser.add_argument("--workers", type=_positive_int, default=2, help="number of worker processes (default 2)")
    parser.add_argument("--config", default=None, help="keras-sync YAML file, passed as KERAS_SYNC_CONFIG")
    parser.add_argument(
        "--grace-period", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL (default 5)"
    )
    parser.add_argument("script", help="the Python script each worker runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    try:
        return launch(
            ns.script, ns.args, workers=ns.workers, config=ns.config, grace_period_s=ns.grace_period
        )
    except KerasSyncError as e:
        sys.stderr.write(f"{parser.prog}: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
