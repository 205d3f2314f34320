"""What the scenario scripts (tests/_*_scenarios.py) share: recorded results, the run's close, the mode switch.

Each scenario script runs many cases in one TensorFlow process (logical devices are fixed per
process) and writes one JSON file that its test module reads. A case that raises is recorded with
its traceback, so the test's failure message shows it, and the next case still runs.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from typing import Any


class Results(dict):
    """The JSON a scenario script writes: one entry per recorded case, plus whatever it adds."""

    def record(self, name: str, fn: Callable[[], Any], *, expected: tuple[type[BaseException], ...] = ()) -> None:
        """``self[name] = fn()``; an ``expected`` error as ``{"error", "message"}``, any other with its traceback."""
        try:
            self[name] = fn()
        except expected as exc:
            self[name] = {"error": type(exc).__name__, "message": str(exc)}
        except Exception as exc:  # a bug: keep the traceback for the test's message
            self[name] = {"unexpected": type(exc).__name__, "message": str(exc), "tb": traceback.format_exc()}

    def dump(self, path: Any) -> None:
        with open(path, "w") as fh:
            json.dump(self, fh, indent=1, default=str)


def close_run(sync: Any, timeout_s: float) -> str | None:
    """End the sync's MLflow run and return its id (the writer's thread creates the run lazily)."""
    from keras_sync.callbacks._run import _writers, close_writer

    writer = _writers[sync]
    close_writer(sync, timeout_s=timeout_s)
    return writer.run_id


def run_mode(modes: dict[str, Callable[..., None]], mode: str, *args: str) -> None:
    """Call ``modes[mode](*args)``; an unknown mode ends the script naming the known ones."""
    if mode not in modes:
        raise SystemExit(f"unknown mode {mode!r}; one of {sorted(modes)}")
    modes[mode](*args)
