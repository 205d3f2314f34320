"""Every worker at the same collective call, or one line saying which worker is elsewhere.

Under `MultiWorkerMirroredStrategy` ``fit``, ``evaluate`` and ``predict`` are collectives: a chief
that calls ``model.predict`` alone waits for peers that never come, then dies with a page of
``UnavailableError``. Before each top-level call, and once at exit after a successful run (so the
workers leave together), each worker posts the call's name in TensorFlow's coordination service and
reads every peer's post.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from keras_sync.cluster import strategy_role, training_tasks
from keras_sync.errors import UsageError
from keras_sync.upstream.strategy_facts import in_multi_worker_mode

EXIT = "exit"
# A worker waiting for a peer's post asks every 2 s whether the peer's process is still there (a
# peer that exits without posting would otherwise cost the whole timeout); a probe that times out
# counts as gone only after 3 in a row, so a busy peer is not taken for a gone one.
_POLL_MS = 2000
_PROBE_MS = 10_000
_PROBE_TRIES = 3

_lock = threading.Lock()
_state: dict[str, Any] = {
    "count": 0,
    "returned": 0,
    "failed": False,
    "strategy": None,
    "timeout_s": 300.0,
}
_local = threading.local()


class PeerElsewhereError(UsageError):
    """A peer posted another call than this worker's: the job cannot go on (both workers report it)."""


def meet(
    strategy: Any,
    call: str,
    timeout_s: float | None = None,
    *,
    on_wait: Callable[[str], None] | None = None,
) -> None:
    """Wait until every worker has reached call number N with the same ``call`` name, or raise
    `UsageError` naming the peer. ``on_wait(peer)`` is called once if a peer is not there at once."""
    if not in_multi_worker_mode(strategy):
        return
    import tensorflow as tf

    from keras_sync.upstream import multi_worker

    timeout_s = _state["timeout_s"] if timeout_s is None else timeout_s
    with _lock:
        n = _state["count"]
        _state["count"] += 1
    resolver = strategy.cluster_resolver
    me = (resolver.task_type, int(resolver.task_id))
    deadline = time.monotonic() + timeout_s
    said = "reached the end of its script" if call == EXIT else f"called {call}"
    fix = (
        f"Under multi_worker_mirrored {call} is a collective: every worker must call it, in the same order. "
        "Fix: make the call on every worker (not under `if sync.is_chief:`), and guard only what your own "
        "code writes; or predict in a separate one-process script from a saved model."
    )
    try:
        multi_worker.set_key(f"keras_sync/call/{n}/{me[0]}:{me[1]}", call)
    except tf.errors.OpError:  # the coordination service's worker (the chief) has exited
        raise UsageError(
            f"{me[0]} {me[1]} {said}, but the job's coordination service is gone: the worker "
            f"that hosts it has left the job. {fix}"
        ) from None
    for peer in training_tasks(resolver.cluster_spec().as_dict()):
        if peer == me:
            continue
        name, slow = f"{peer[0]} {peer[1]}", 0
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            try:
                got = multi_worker.get_key(
                    f"keras_sync/call/{n}/{peer[0]}:{peer[1]}", max(1, min(left_ms, _POLL_MS))
                )
                break
            except tf.errors.DeadlineExceededError:
                if on_wait is not None:
                    on_wait(name)
                    on_wait = None
                if left_ms <= _POLL_MS:
                    raise UsageError(
                        f"{me[0]} {me[1]} {said}, but {name} did not reach that call within "
                        f"strategy.connect_timeout_s={timeout_s:g} s. {fix}"
                    ) from None
            except tf.errors.OpError as e:
                why = (
                    "TensorFlow can no longer reach it"
                    if isinstance(e, tf.errors.UnavailableError)
                    else f"TensorFlow: {type(e).__name__}"
                )
                raise UsageError(
                    f"{me[0]} {me[1]} {said}, but {name} has left the job ({why}). {fix}"
                ) from None
            # The probe of MultiWorkerMirroredStrategy's own health thread: an exited peer answers
            # Unavailable (FailedPrecondition once restarted); a TensorFlow without it, anything else.
            try:
                multi_worker.peer_health(f"/job:{peer[0]}/replica:0/task:{peer[1]}", _PROBE_MS)
                slow = 0
            except (tf.errors.UnavailableError, tf.errors.FailedPreconditionError):
                slow = _PROBE_TRIES
            except tf.errors.DeadlineExceededError:
                slow += 1
            except Exception:
                slow = 0
            if slow >= _PROBE_TRIES:
                raise UsageError(
                    f"{me[0]} {me[1]} {said}, but {name} has left the job (its process no longer answers). {fix}"
                )
        if got != call:
            got_said = "reached the end of its script" if got == EXIT else f"called {got}"
            raise PeerElsewhereError(
                f"{me[0]} {me[1]} {said}, but {name} {got_said} instead. {fix}"
            )


@contextlib.contextmanager
def collective(model: Any, call: str) -> Iterator[None]:
    """Around one top-level ``call`` of ``model``: meet the peers first, count the call after it.
    Nested calls (fit's validation ``evaluate``) and models not under a multi-worker strategy pass."""
    strategy = getattr(model, "_distribute_strategy", None)
    if getattr(_local, "depth", 0) or not in_multi_worker_mode(strategy):
        yield
        return
    meet(strategy, call)
    _local.depth = 1
    try:
        yield
        _state["returned"] += 1
    except BaseException:
        _state["failed"] = True  # peers may still be inside this collective: no exit meeting
        raise
    finally:
        _local.depth = 0


def configure(strategy: Any, timeout_s: float) -> None:
    """The job's strategy and wait for `meet`; the exit meeting is registered once per process."""
    with _lock:
        first = _state["strategy"] is None
        _state["strategy"], _state["timeout_s"] = strategy, timeout_s
    if first:
        atexit.register(_meet_at_exit)


def _meet_at_exit() -> None:
    if not _state["returned"] or _state["failed"] or getattr(sys, "last_value", None) is not None:
        return  # not after a successful run: the peers may be stuck in a collective, or not there yet

    def say(peer: str) -> None:
        print(
            f"keras-sync: waiting for {peer} to finish its script (the workers leave together; closing "
            "TensorFlow's input pipeline can take seconds)",
            file=sys.stderr,
            flush=True,
        )

    try:
        meet(
            _state["strategy"],
            EXIT,
            on_wait=say if strategy_role(_state["strategy"]).is_chief else None,
        )
    except UsageError as e:
        # A peer is in another call: that worker reports it; this one leaves with one line.
        print(f"keras-sync: {str(e).split('. Under')[0]}.", file=sys.stderr, flush=True)
        if isinstance(e, PeerElsewhereError):
            # That peer fails now, and when it is the chief the coordination service goes with it:
            # TensorFlow's teardown here would print pages of heartbeat errors or wait for a leader
            # that is gone. Leave at once with the job's usage-error code 2.
            sys.stdout.flush()
            os._exit(2)
