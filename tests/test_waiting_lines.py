"""The lines that say what a wait is for: the config line comes before TensorFlow starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess

# stderr is wrapped so that each line records whether TensorFlow was imported when it was written:
# the order of imports, not a timing.
_FIRST_LINE = r"""
import sys
class Watch:
    def __init__(self, out): self.out = out
    def write(self, s):
        if s.strip(): self.out.write(f"[tensorflow {'in' if 'tensorflow' in sys.modules else 'not in'} sys.modules] ")
        return self.out.write(s)
    def flush(self): self.out.flush()
    def isatty(self): return False
sys.stderr = Watch(sys.__stderr__)
import keras_sync
sync = keras_sync.load({"strategy": {"kind": "mirrored", "simulated_cpu_replicas": 2}, "mlflow": {"enabled": False}})
print("replicas", sync.num_replicas, "tensorflow imported:", "tensorflow" in sys.modules)
"""


def test_config_line_comes_before_tensorflow_is_imported(tmp_path: Path) -> None:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    r = subprocess.run(
        [sys.executable, "-c", _FIRST_LINE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [
        "replicas",
        "2",
        "tensorflow",
        "imported:",
        "True",
    ]  # load() did start it
    first = r.stderr.splitlines()[0]
    assert first == (
        "[tensorflow not in sys.modules] keras-sync: config: a dict passed to keras_sync.load() "
        "(no file); starting TensorFlow and the mirrored strategy"
    ), r.stderr[-3000:]


_SLOW_END = r"""
import sys, time
from keras_sync.tracking import MlflowWriter
w = MlflowWriter(tracking_uri=sys.argv[1], experiment="slow-end", spool_dir=sys.argv[2])
w.start()
w.log_metrics({"loss": 1.0}, step=0)
assert w.flush(timeout_s=120), "the metric point was not delivered"
print("delivered", flush=True)
open(sys.argv[3], "w").write("slow")  # from now on each request to MLflow takes 3 s
"""


def _slow_proxy(target: int, delay_file: Path) -> int:
    """A TCP proxy to 127.0.0.1:``target`` that holds each request 3 s once ``delay_file`` exists."""
    import socket
    import threading
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def pipe(src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while data := src.recv(65536):
                if slow and delay_file.exists():
                    time.sleep(3.0)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def serve() -> None:
        while True:
            client, _ = listener.accept()
            upstream = socket.create_connection(("127.0.0.1", target))
            threading.Thread(target=pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, client, False), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def test_exit_says_what_it_waits_for_when_the_server_is_slow(tmp_path: Path) -> None:
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # `mlflow server` runs uvicorn as a child: the kill ends both
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, (
                    "mlflow server did not start"
                )
                time.sleep(0.5)
        delay = tmp_path / "slow"
        proxy = _slow_proxy(port, delay)
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                _SLOW_END,
                f"http://127.0.0.1:{proxy}",
                str(tmp_path / "spool"),
                str(delay),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["delivered"]
    assert (
        f"keras-sync: waiting for MLflow (http://127.0.0.1:{proxy}) to receive the run's last records "
        f"before exit. Ctrl-C leaves them in {tmp_path / 'spool'}/"
    ) in r.stderr, r.stderr[-3000:]
    assert " for `keras-sync sync-spool " in r.stderr, r.stderr[-3000:]
