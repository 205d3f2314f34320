"""Why records are not in MLflow yet, and where they wait, in words for the user."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from keras_sync.tracking.handover import step_ranges
from keras_sync.tracking.records import BOOKKEEPING, METRICS, cause_in_a_word, cause_in_words

__all__ = ["cause", "cause_in_a_word", "lost_text", "refused_line", "undelivered_message"]

#: A wait for delivery gives up when the delivered position has not moved for this long (seconds).
STALL_S = 30.0


def cause(failed: dict[str, Any] | None, shown_uri: str, running: bool, tried: bool) -> str:
    """Why delivery is behind: the courier's last failure, or what the courier is doing."""
    if failed is not None:
        return f"{cause_in_words(failed.get('cause'), shown_uri)} ({failed.get('error', '')})"
    if not running:
        return f"the courier process that delivers to {shown_uri} is not running"
    if not tried:
        return (
            f"the courier process had not reached {shown_uri} yet (it starts by importing "
            "MLflow: seconds, more on a busy machine)"
        )
    return (
        f"delivery to {shown_uri} made no progress for {STALL_S:g} s (the courier process gets no "
        "CPU time, or MLflow does not answer)"
    )


def refused_line(uri: str, shown_uri: str, failed: dict[str, Any], spool: Path) -> str:
    """The one line said when the tracking server refused the credentials."""
    again = f"keras-sync sync-spool {spool}"
    if shown_uri != uri:
        again += " --tracking-uri URI"
    return (
        f"keras-sync: MLflow at {shown_uri} refused the credentials ({failed.get('error')}); "
        f"training goes on and the metrics are kept in {spool}. Set MLFLOW_TRACKING_USERNAME and "
        f"MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN), then deliver them with: {again}"
    )


def lost_text(steps: list[int], others: int, spool: Path, spool_error: str | None) -> str:
    """What a full disk cost: the steps (and other records) MLflow never got."""
    what = f"the points of steps {step_ranges(steps)}" if steps else "no metric points"
    if others:
        what += f" and {others} other record(s)"
    return (
        f"{what}: the spool {spool} could not be written ({spool_error}) while MLflow did not "
        "take them"
    )


def undelivered_message(
    spooled: list[dict[str, Any]],
    held: list[dict[str, Any]],
    queued: list[dict[str, Any]],
    why: str,
    *,
    spool: Path,
    spool_error: str | None,
    credentials_hidden: bool,
    final: bool,
) -> str | None:
    """Why some records are not in MLflow, and where they are; None if everything arrived.

    ``spooled``, ``held`` (in this process's memory only), ``queued``: what MLflow does not have.
    """
    held = [rec for rec in held if rec["k"] not in BOOKKEEPING]
    count = len(queued) + len(held) + sum(rec["k"] not in BOOKKEEPING for rec in spooled)
    if count == 0:
        return None
    if held and not final:
        steps = step_ranges([rec["s"] for rec in held if rec["k"] == METRICS]) or "none"
        return (
            f"keras-sync: {count} MLflow record(s) are not delivered yet: {why}. The spool "
            f"{spool} cannot be written ({spool_error}), so {len(held)} of them (steps {steps}) wait "
            "in this process's memory: they are lost if it ends before MLflow takes them."
        )
    points = sum(
        len(rec.get("d", ())) for rec in (*spooled, *held, *queued) if rec.get("k") == METRICS
    )
    what = f"{count} MLflow record(s)" + (f" ({points} metric point(s))" if points else "")
    if final:
        where = f"Deliver them with: keras-sync sync-spool {spool}"
        if credentials_hidden:
            where += " --tracking-uri URI (the spool keeps the URI without its credentials)"
    else:
        where = (
            "Delivery goes on in the background while this process runs; what is left at exit "
            f"stays there for `keras-sync sync-spool {spool}`"
        )
    return f"keras-sync: {what} are not delivered yet: {why}. They are kept in {spool}. {where}."
