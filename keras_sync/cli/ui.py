from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import click

from keras_sync.cli._base import UserError


@click.command("ui")
@click.argument("config", required=False, type=click.Path())
@click.option(
    "--tracking-uri", help="The store to show; wins over $MLFLOW_TRACKING_URI and the config."
)
@click.option("--port", type=click.IntRange(1, 65535), default=5000, help="Port on 127.0.0.1.")
@click.option("--no-browser", is_flag=True, help="Do not open a browser.")
def command(config: str | None, tracking_uri: str | None, port: int, no_browser: bool) -> None:
    """Serve the MLflow UI for CONFIG's tracking store on 127.0.0.1 until Ctrl-C.

    The store is the one training logs to, by the same rule: --tracking-uri, else
    $MLFLOW_TRACKING_URI, else mlflow.tracking_uri in CONFIG, else sqlite:///<cwd>/mlflow.db.
    When that store does not exist here, the default or a relative store beside CONFIG is used
    (training ran in CONFIG's folder), so the command works from any folder. The server's own
    output goes to a log file whose path it prints.
    """
    from keras_sync.config import load_config
    from keras_sync.tracking import redact_uri, resolve_tracking_uri
    from keras_sync.tracking.records import is_remote
    from keras_sync.tracking.sqlite_store import sqlite_path

    overrides = {"mlflow.tracking_uri": tracking_uri} if tracking_uri else None
    cfg = load_config(config, overrides=overrides)
    uri, source = resolve_tracking_uri(cfg.mlflow.tracking_uri)
    if is_remote(uri):
        click.echo(f"The config points at a tracking server already: open {redact_uri(uri)}")
        return
    parsed = urlparse(uri)  # the file or directory of a local store, else None
    store = Path(uri) if len(parsed.scheme) < 2 else None  # a path (or a Windows drive letter)
    if uri.startswith("sqlite:"):
        store = sqlite_path(uri)
    elif parsed.scheme == "file":
        store = Path(unquote(parsed.path))
    if store is not None and not store.exists():
        # Training resolved the default (or a relative) store against its folder, usually the config's.
        relative = Path(store.name) if source == "default" else store
        beside = (Path(cfg.source).resolve().parent / relative).resolve()
        if cfg.source.startswith("<") or relative.is_absolute() or not beside.exists():
            raise UserError(  # mlflow server would create an empty store and show nothing
                f"No MLflow store at {store} ({redact_uri(uri)}): nothing has been logged there yet. "
                "Expected the store of a training run: run keras-sync ui in the directory you trained "
                "in, pass that run's config, or set MLFLOW_TRACKING_URI to its store."
            )
        click.echo(f"No MLflow store at {store}; using the one beside {cfg.source}: {beside}")
        uri = f"sqlite:///{beside}" if uri.startswith("sqlite:") else str(beside)
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            used = f"Invalid value for --port. Received: {port}, which is in use on 127.0.0.1."
            raise UserError(f"{used} Fix: pass a free one, e.g. --port 5001.") from None
    url = f"http://127.0.0.1:{port}"
    # The server's advice (e.g. --host 0.0.0.0) fits `mlflow server`, not us: its output goes to a log.
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host"]
    cmd += ["127.0.0.1", "--port", str(port), "--workers", "1"]
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    fd, log_name = tempfile.mkstemp(prefix=f"keras-sync-ui-{port}-", suffix=".log")
    log = Path(log_name)
    with open(fd, "wb") as out:
        server = subprocess.Popen(
            cmd, env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
    click.echo(f"MLflow UI for {redact_uri(uri)} at {url} (Ctrl-C to stop)")
    click.echo(f"MLflow's own output goes to {log}")
    # Ctrl-C and SIGTERM stop the server, also when SIGINT came ignored (a background job).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)  # raises KeyboardInterrupt
    try:
        if _wait_ready(url, server) and not no_browser:
            import webbrowser

            webbrowser.open(url)
        code = server.wait()
        last = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1].strip()
        raise UserError(f"mlflow server exited with code {code}: {last} (all of its output: {log})")
    except KeyboardInterrupt:
        # SIGTERM to its process group (its web workers too), not SIGINT: it may ignore that.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(server.pid, sig)
                server.wait(timeout=10)
                break
        click.echo("MLflow UI stopped.")


def _wait_ready(url: str, server: subprocess.Popen[bytes]) -> bool:
    """Poll the server's health page for up to 60 s."""
    import urllib.request  # not on the path of `keras-sync --help`

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status == 200:
                    click.echo("ready")
                    return True
        except OSError:
            time.sleep(0.25)
    return False
