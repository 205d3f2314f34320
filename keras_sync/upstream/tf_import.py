"""Import TensorFlow without the C++ INFO lines absl logs before it is initialised (oneDNN,
cpu_feature_guard, "WARNING: All log messages before absl::InitializeLog() ..."), which
TF_CPP_MIN_LOG_LEVEL does not stop: fd 2 is held during the import, the rest written back."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

_INFO = re.compile(rb"^I\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.\-]+:\d+\] ")
_BANNER = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
#: An INFO line's continuation (cpu_feature_guard's second line): kept with it.
_CONTINUATION = re.compile(rb"^(To enable the following instructions|other operations, rebuild)")


def quiet_lines(raw: bytes) -> bytes:
    """``raw`` without TensorFlow's early INFO lines (with their continuations) and absl's banner."""
    out, dropping = [], False
    for line in raw.splitlines(keepends=True):
        bare = line.rstrip(b"\r\n")
        if bare == _BANNER or _INFO.match(bare):
            dropping = True
            continue
        if dropping and _CONTINUATION.match(bare):
            continue
        dropping = False
        out.append(line)
    return b"".join(out)


def import_tensorflow() -> None:
    """``import tensorflow``, without its start-up INFO lines unless TF_CPP_MIN_LOG_LEVEL is 0."""
    saved = None
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip()
    if "tensorflow" not in sys.modules and level not in ("", "0"):
        with contextlib.suppress(OSError, ValueError):  # no usable fd 2 (embedded interpreter)
            sys.stderr.flush()
            saved = os.dup(2)
    if saved is None:
        import tensorflow

        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            raw = held.read()
            text = quiet_lines(raw) if "tensorflow" in sys.modules else raw  # failed: every line
            if text:
                os.write(2, text)
