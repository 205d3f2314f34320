"""A keras-sync error that ends a user's script prints one line and exits 2, no traceback."""

from __future__ import annotations

import subprocess
import sys


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_config_error_in_script_is_one_line_exit_2():
    r = run(
        "import keras_sync\nkeras_sync.load({'batch': {'per_replica': 0}})\nprint('not reached')"
    )
    assert r.returncode == 2
    assert (
        r.stderr
        == "keras-sync: <dict>: batch.per_replica: received 0, expected an integer >= 1 or null\n"
    )
    assert r.stdout == ""


def test_other_errors_keep_their_traceback():
    r = run(
        "import keras_sync\nkeras_sync.load({'strategy': {'kind': 'default'}})\nraise ValueError('mine')"
    )
    assert r.returncode == 1 and "Traceback" in r.stderr and "ValueError: mine" in r.stderr


def test_traceback_on_request():
    r = run(
        "import keras_sync\nkeras_sync.load({'batch': {'per_replica': 0}})",
        KERAS_SYNC_TRACEBACK="1",
    )
    assert r.returncode == 1 and "Traceback" in r.stderr and "ConfigError" in r.stderr


def test_a_caught_error_lets_the_script_go_on_and_python_keeps_its_own_hook():
    r = run(
        "import sys, keras_sync\n"
        "try:\n    keras_sync.load({'batch': {'per_replica': 0}})\n"
        "except Exception as e:\n    print(type(e).__name__)\n"
        "print(sys.excepthook is sys.__excepthook__)"
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, "ConfigError\nTrue\n", "")
