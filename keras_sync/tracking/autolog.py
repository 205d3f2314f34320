"""Living beside `mlflow.keras.autolog()`: one run for both, no param logged twice.

`Sync.fit` makes keras-sync's run the active one (chief only, for the length of `fit`), and the
callbacks leave out what autolog logs itself. MLflow is imported only if the user's code has.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from keras_sync.tracking.deliver import environ_restored
from keras_sync.upstream.mlflow_internals import autologging

#: Tag set on a keras-sync run that mlflow.keras.autolog() logged into as well.
AUTOLOG_TAG = "keras_sync.autolog"
#: Longest `Sync.fit` waits for keras-sync's run to exist before autolog would make its own.
RUN_WAIT_S = 120.0


def keras_autolog_active() -> bool:
    """True when ``mlflow.keras.autolog()`` is on (False if MLflow was never imported)."""
    if "mlflow.keras" not in sys.modules:  # autolog imports it; never import MLflow just to ask
        return False
    return not autologging().autologging_is_disabled("keras")


@contextlib.contextmanager
def shared_run(writer: Any, tracking_uri: str, *, is_chief: bool = True) -> Iterator[None]:
    """Make ``writer``'s run the active one while autolog is on; other workers turn autolog off."""
    if not keras_autolog_active() or (is_chief and writer is None):
        yield
        return
    if not is_chief:
        with autologging().disable_autologging():
            yield
        return
    import mlflow

    if mlflow.active_run() is not None:
        yield
        return
    writer.set_tags({AUTOLOG_TAG: "true"})  # something to deliver: the courier creates the run
    if not writer.flush(timeout_s=RUN_WAIT_S) or writer.run_id is None:
        warnings.warn(
            "keras-sync: its MLflow run could not be created in time, so mlflow.keras.autolog() "
            "logs this fit to a run of its own.",
            UserWarning,
            stacklevel=4,
        )
        yield
        return
    previous_uri = mlflow.get_tracking_uri()
    # mlflow.set_tracking_uri also writes $MLFLOW_TRACKING_URI, which keras_sync.load() reads.
    with environ_restored("MLFLOW_TRACKING_URI"):
        mlflow.set_tracking_uri(tracking_uri)  # autolog logs through the fluent API
        try:
            mlflow.start_run(run_id=writer.run_id)
            try:
                yield
            finally:
                # FINISHED until the next fit resumes it; the writer ends it for real at the job's end.
                with contextlib.suppress(Exception):
                    mlflow.end_run()
        finally:
            mlflow.set_tracking_uri(previous_uri)
