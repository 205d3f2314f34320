"""What the scenario scripts (tests/_*_scenarios.py) share: recorded results, the run's close, the mode switch.

Each scenario script runs many cases in one TensorFlow process (logical devices are fixed per
process) and writes one JSON file that its test module reads. A case that raises is recorded with
its traceback, so the test's failure message shows it, and the next case still runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The environment variable a test module's fixture sets to the cases its selected tests read
#: (comma-separated; unset: every case). See `wanted_cases`.
WANTED_ENV = "KS_SCENARIOS"


class Results(dict):
    """The JSON a scenario script writes: one entry per recorded case, plus whatever it adds."""

    def __init__(self, **items: Any) -> None:
        super().__init__(**items)
        wanted = os.environ.get(WANTED_ENV)
        self.wanted = None if wanted is None else set(filter(None, wanted.split(",")))

    def wants(self, name: str) -> bool:
        """Whether a selected test reads case ``name`` (True when no selection was given)."""
        return self.wanted is None or name in self.wanted

    def record(
        self, name: str, fn: Callable[[], Any], *, expected: tuple[type[BaseException], ...] = ()
    ) -> None:
        """``self[name] = fn()``; an ``expected`` error as ``{"error", "message"}``, any other with its traceback.

        A case no selected test reads is not run (see `wants`).
        """
        if not self.wants(name):
            return
        began = time.process_time()
        try:
            self[name] = fn()
        except expected as exc:
            self[name] = {"error": type(exc).__name__, "message": str(exc)}
        except Exception as exc:  # a bug: keep the traceback for the test's message
            self[name] = {
                "unexpected": type(exc).__name__,
                "message": str(exc),
                "tb": traceback.format_exc(),
            }
        if os.environ.get(
            "KERAS_SYNC_TEST_CPU"
        ):  # the suite's CPU log (tests/conftest.py): what each case costs
            with open(os.environ["KERAS_SYNC_TEST_CPU"], "a") as fh:
                fh.write(
                    f"{time.process_time() - began:.1f} case {Path(sys.argv[0]).name}:{name} "
                    f"{' '.join(sys.argv[1:2])} {time.time():.1f}\n"
                )

    def dump(self, path: Any) -> None:
        with open(path, "w") as fh:
            json.dump(self, fh, indent=1, default=str)


def close_run(sync: Any, timeout_s: float) -> str | None:
    """End the sync's MLflow run and return its id (the writer's thread creates the run lazily)."""
    writer = sync.job_run.current
    sync.close(timeout_s=timeout_s)
    return writer.run_id


def run_mode(modes: dict[str, Callable[..., None]], mode: str, *args: str) -> None:
    """Call ``modes[mode](*args)``; an unknown mode ends the script naming the known ones."""
    if mode not in modes:
        raise SystemExit(f"unknown mode {mode!r}; one of {sorted(modes)}")
    modes[mode](*args)


def wanted_cases(request: Any, fixture: str, needs: dict[str, set[str]]) -> str | None:
    """What a module fixture puts in `WANTED_ENV`: the cases its module's selected tests read.

    ``needs`` maps a test function's name to the cases it reads. A selected test that uses
    ``fixture`` and is not in ``needs`` makes it None (every case runs), so a new test is never
    starved. The whole suite selects every test; `pytest -m compat` (the CI lanes) or `-k` run less.
    """
    cases: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module or fixture not in getattr(
            item, "fixturenames", ()
        ):
            continue
        name = getattr(item, "originalname", None) or item.name
        if name not in needs:
            return None
        cases |= needs[name]
    return ",".join(sorted(cases))
