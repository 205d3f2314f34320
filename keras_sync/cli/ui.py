"""``keras-sync ui``: the MLflow UI over the store the config points at, on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import click

from keras_sync.cli._base import UserError

_READY_TIMEOUT_S = 60.0  # a fresh store's migrations and the server's start, on a busy machine
_STOP_TIMEOUT_S = 10.0


@click.command("ui")
@click.argument("config", required=False, type=click.Path(path_type=str))
@click.option(
    "--tracking-uri", help="The store to show; wins over $MLFLOW_TRACKING_URI and the config."
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=5000,
    show_default=True,
    help="Port on 127.0.0.1.",
)
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

    cfg = load_config(
        config, overrides={"mlflow.tracking_uri": tracking_uri} if tracking_uri else None
    )
    uri, source = resolve_tracking_uri(cfg.mlflow.tracking_uri)
    if is_remote(uri):
        click.echo(f"The config points at a tracking server already: open {redact_uri(uri)}")
        return
    store = _local_store(uri)
    beside = _store_beside_config(store, source, cfg.source)
    if beside is not None:
        # Training resolves the default (or a relative) store against its own folder, usually the
        # config's: from another folder the same config finds it there.
        click.echo(f"No MLflow store at {store}; using the one beside {cfg.source}: {beside}")
        store, uri = beside, f"sqlite:///{beside}" if uri.startswith("sqlite:") else str(beside)
    if store is not None and not store.exists():
        # mlflow server would create an empty store here and show nothing: say where we looked
        raise UserError(
            f"No MLflow store at {store} ({redact_uri(uri)}): nothing has been logged there yet. "
            f"Expected the store of a training run: run keras-sync ui in the directory you trained "
            f"in, pass that run's config, or set MLFLOW_TRACKING_URI to its store."
        )
    _check_port_free(port)
    url = f"http://127.0.0.1:{port}"
    log = _server_log(port)
    server = _start_server(uri, port, log)
    click.echo(f"MLflow UI for {redact_uri(uri)} at {url} (Ctrl-C to stop)")
    click.echo(f"MLflow's own output goes to {log}")
    # Stop the server on Ctrl-C and SIGTERM, also when started with SIGINT ignored (a background
    # job of a non-interactive shell inherits that, and Ctrl-C would then do nothing).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        if _wait_ready(url, server) and not no_browser:
            import webbrowser

            webbrowser.open(url)
        code = server.wait()
        raise UserError(
            f"mlflow server exited with code {code}: {_last_line(log)} (all of its output: {log})"
        )
    except KeyboardInterrupt:
        _stop(server)
        click.echo("MLflow UI stopped.")


def _local_store(uri: str) -> Path | None:
    """The file or directory of a local store (sqlite:///x.db, file:///dir, a plain path), else None."""
    from urllib.parse import unquote, urlparse

    if uri.startswith("sqlite:///"):
        return (
            Path(unquote(uri[len("sqlite:///") :].split("?")[0]))
            if uri != "sqlite:///:memory:"
            else None
        )
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # a plain path (or a Windows drive letter)
        return Path(uri)
    return None  # another database or server: mlflow server reports its own errors


def _store_beside_config(store: Path | None, source: str, config_file: str) -> Path | None:
    """The same store resolved against the config file's folder, when the one here does not exist."""
    if store is None or store.exists() or config_file.startswith("<"):
        return None
    if source == "default":
        relative = Path(store.name)
    elif not store.is_absolute():
        relative = store
    else:
        return None  # an absolute path in the config means that file, wherever ui runs
    candidate = (Path(config_file).resolve().parent / relative).resolve()
    return candidate if candidate.exists() and candidate != store.resolve() else None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise UserError(
                f"Invalid value for --port. Received: {port}, which is in use on 127.0.0.1. "
                "Expected a free port; pass another, e.g. --port 5001."
            ) from None


def _server_log(port: int) -> Path:
    """A new file for the server's output (its own advice, e.g. `--host 0.0.0.0`, fits `mlflow server`, not us)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix=f"keras-sync-ui-{port}-", suffix=".log")
    os.close(fd)
    return Path(path)


def _last_line(log: Path) -> str:
    try:
        lines = [
            ln.strip()
            for ln in log.read_text(encoding="utf-8", errors="replace").splitlines()
            if ln.strip()
        ]
    except OSError:
        return "no output"
    return lines[-1] if lines else "no output"


def _start_server(uri: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    # One worker and no job runner: the server is ready in about half the time.
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    # Its own process group, so stopping it also stops the web workers it forks.
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait_ready(url: str, server: subprocess.Popen[bytes]) -> bool:
    import urllib.request  # not on the path of `keras-sync --help`

    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status == 200:
                    click.echo("ready")
                    return True
        except OSError:
            time.sleep(0.25)
    return False


def _stop(server: subprocess.Popen[bytes]) -> None:
    # SIGTERM, not SIGINT: the server may have inherited SIGINT ignored from us.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=_STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            continue
