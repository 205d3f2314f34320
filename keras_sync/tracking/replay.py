"""``keras-sync sync-spool``: deliver what a spool holds once the process that wrote it has ended."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from keras_sync.errors import TrackingError
from keras_sync.tracking import courier as _courier
from keras_sync.tracking.records import METRICS
from keras_sync.tracking.redact import redact_text as _redact
from keras_sync.tracking.spool import SpoolDir

#: How long ``keras-sync sync-spool`` retries failing requests before it gives up (seconds).
REPLAY_TIMEOUT_S = 600.0


def replay_spool(
    spool_path: str | os.PathLike[str],
    tracking_uri: str | None = None,
    *,
    timeout_s: float = REPLAY_TIMEOUT_S,
    progress: Any = None,
) -> int:
    """Deliver what a spool directory holds; return the metric points sent.

    Idempotent: the delivered position moves after every batch, and a step a metric already has
    is not sent again. ``tracking_uri`` defaults to the one in the spool (kept without
    credentials: pass it again if the server needs them). A fully delivered spool is removed.
    Backs ``keras-sync sync-spool DIR``.

    Each request that fails (no answer, HTTP 503) is retried on its own as the courier does
    (`keras_sync.tracking.retry`) until ``timeout_s`` has passed (0: each request is tried once);
    a refusal (a bad request, refused credentials) stops at once. ``progress(sent, total, failures)``
    is called after each request that failed or delivered points: metric points sent, points the
    spool held, and what failed in words ("7 of 40 requests failed with HTTP 503", or "").
    """
    path = Path(spool_path)
    if path.is_file():  # a file of the spool (its header, a segment) names the spool too
        path = path.parent
    spool = SpoolDir(path)
    if not path.is_dir():
        raise TrackingError(
            f"Invalid value for argument `spool_path`. Received: spool_path={str(spool_path)!r}, "
            "which does not exist. Expected a spool directory left by a writer (a fully "
            "delivered spool is removed, so there is nothing left to send)."
        )
    if spool.header() is None:
        raise TrackingError(
            f"Invalid value for argument `spool_path`. Received: spool_path={str(spool_path)!r}. "
            "Expected a keras-sync spool directory (it holds header.json and *.jsonl segments)."
        )
    if not spool.lock("writer") or not spool.lock("deliver"):
        spool.unlock("writer")
        raise TrackingError(
            f"Spool {path} is in use by a running keras-sync writer, which delivers it itself; "
            "replay it after that process has ended."
        )
    delivery = _courier.Delivery(spool, tracking_uri)
    deadline = time.monotonic() + max(0.0, timeout_s)
    delivery.give_up = lambda: time.monotonic() >= deadline
    total = sum(
        len(rec["d"])
        for _, rec in spool.read(delivery.pos, max_records=10**9)
        if rec["k"] == METRICS
    )
    if progress is not None:
        delivery.on_progress = lambda: progress(
            delivery.sender.points_sent, total, delivery.sender.retrier.summary()
        )
    try:
        sent = delivery.deliver_available()
        delivery.sender.release_report()  # one a courier held when its process ended
    except Exception as e:
        from keras_sync.tracking.deliver import refused_credentials

        http = refused_credentials(e)
        if http is not None:  # the status, not the server's page
            raise TrackingError(
                f"Could not deliver spool {path}: MLflow at {delivery.shown_uri} refused the credentials (HTTP {http}). "
                "Set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) and run "
                "`keras-sync sync-spool` again; nothing delivered is sent twice."
            ) from None
        from keras_sync.tracking.deliver import is_transient

        failures = delivery.sender.retrier.summary()
        if (
            is_transient(e) and failures
        ):  # retried until the time was up: what happened, not the last error
            left = total - delivery.sender.points_sent
            raise TrackingError(
                f"Could not deliver spool {path} to MLflow at {delivery.shown_uri} within {timeout_s:g} s: "
                f"{failures}; {left} of {total} metric point(s) are left in it. Nothing delivered is sent twice; "
                "run `keras-sync sync-spool` again (a longer --timeout waits longer)."
            ) from None
        raise TrackingError(
            f"Could not deliver spool {path} to MLflow at {delivery.shown_uri}: "
            f"{_redact(str(e), delivery.secrets)[:500].rstrip('.')}. Nothing delivered is sent twice; run "
            "`keras-sync sync-spool` again once MLflow there can take them (or give --tracking-uri)."
        ) from None
    finally:
        spool.unlock("deliver")
        spool.unlock("writer")
    if (
        not delivery.pending()
    ):  # not spool.pending(): on a full disk the delivered position may not be on file
        spool.remove()
    return sent
