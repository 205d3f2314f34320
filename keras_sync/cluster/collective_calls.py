"""Every worker at the same collective call, or one line saying which worker is elsewhere.

Under `MultiWorkerMirroredStrategy`, ``model.fit``, ``evaluate`` and ``predict`` are collectives: a
chief that calls ``model.predict`` alone waits for peers that never come, then dies with a page of
``UnavailableError``; a worker that ends its script while another still runs makes that one print
``tasks are unhealthy`` even after a successful run.

Before each top-level ``fit``/``evaluate``/``predict`` of a multi-worker model, and once at
process exit, each worker posts the call's name under its call number in TensorFlow's
coordination service and reads every peer's post. Another name, or none within
``strategy.connect_timeout_s``: a `UsageError` saying that every worker must make the call. The
exit post makes workers leave together. A worker meets its peers at exit only after a successful
run (a counted call returned, none raised, no exception ending the script); otherwise it leaves
at once.

Keras's classes are left as they are: a model compiled in ``sync.scope()``, or given to
``sync.fit``/``evaluate``/``predict``/``callbacks``, gets its own checked methods (`meets_peers`);
``sync.fit``, which calls the class's ``fit``, checks its call with `collective`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from keras_sync.cluster import TRAINING_JOBS
from keras_sync.errors import UsageError
from keras_sync.upstream.strategy_facts import in_multi_worker_mode

_KEY = "keras_sync/call/{n}/{task}"
_WRAPPED_MARK = "_keras_sync_meets_peers"
EXIT = "exit"

_lock = threading.Lock()
_state: dict[str, Any] = {
    "count": 0,
    "returned": 0,
    "failed": False,
    "strategy": None,
    "timeout_s": 300.0,
}
_local = threading.local()


def _task_names(strategy: Any) -> tuple[str, list[str]]:
    """``("worker:1", ["worker:0", "worker:1"])``: this task and every training task."""
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec().as_dict()
    tasks = [f"{job}:{i}" for job in TRAINING_JOBS for i in range(len(spec.get(job, [])))]
    return f"{resolver.task_type}:{resolver.task_id}", tasks


def _said(call: str) -> str:
    return "reached the end of its script" if call == EXIT else f"called {call}"


def meet(
    strategy: Any,
    call: str,
    timeout_s: float | None = None,
    *,
    on_wait: Callable[[str], None] | None = None,
) -> None:
    """Wait until every worker has reached call number N with the same ``call`` name.

    ``on_wait(peer)`` is called once if a peer has not posted within the first poll (`_POLL_MS`).

    Raises:
        UsageError: a peer reached another call (or the end of its script) instead, or none
            within ``timeout_s``.
    """
    if not in_multi_worker_mode(strategy):
        return
    import tensorflow as tf

    from keras_sync.upstream import multi_worker as _mw

    timeout_s = _state["timeout_s"] if timeout_s is None else timeout_s
    with _lock:
        n = _state["count"]
        _state["count"] += 1
    me, tasks = _task_names(strategy)
    deadline = time.monotonic() + timeout_s
    fix = (
        f"Under multi_worker_mirrored {call} is a collective: every worker must call it, in the same order. "
        "Fix: make the call on every worker (not under `if sync.is_chief:`), and guard only what your own "
        "code writes; or predict in a separate one-process script from a saved model."
    )
    try:
        _mw.set_key(_KEY.format(n=n, task=me), call)
    except tf.errors.OpError:  # the coordination service's worker (the chief) has exited
        raise UsageError(
            f"{_name(me)} {_said(call)}, but the job's coordination service is gone: the worker "
            f"that hosts it has left the job. {fix}"
        ) from None
    probe = _Liveness()
    for peer in tasks:
        if peer == me:
            continue
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            try:
                got = _mw.get_key(_KEY.format(n=n, task=peer), max(1, min(left_ms, _POLL_MS)))
                break
            except tf.errors.DeadlineExceededError:
                if on_wait is not None:
                    on_wait(_name(peer))
                    on_wait = None
                if left_ms <= _POLL_MS:
                    raise UsageError(
                        f"{_name(me)} {_said(call)}, but {_name(peer)} did not reach that call within "
                        f"strategy.connect_timeout_s={timeout_s:g} s. {fix}"
                    ) from None
            except tf.errors.OpError as e:
                why = (
                    "TensorFlow can no longer reach it"
                    if isinstance(e, tf.errors.UnavailableError)
                    else f"TensorFlow: {type(e).__name__}"
                )
                raise UsageError(
                    f"{_name(me)} {_said(call)}, but {_name(peer)} has left the job ({why}). {fix}"
                ) from None
            if probe.gone(peer):
                raise UsageError(
                    f"{_name(me)} {_said(call)}, but {_name(peer)} has left the job (its process no longer "
                    f"answers). {fix}"
                ) from None
        if got != call:
            raise PeerElsewhereError(
                f"{_name(me)} {_said(call)}, but {_name(peer)} {_said(got)} instead. {fix}"
            )


class PeerElsewhereError(UsageError):
    """A peer posted another call than this worker's: the job cannot go on (both workers report it)."""


# How often a worker waiting for a peer's post asks whether the job has failed (a peer that exits
# without posting, e.g. `os._exit` or a crash after training, would otherwise cost the whole timeout).
_POLL_MS = 2000
_PROBE_MS = 10_000
_PROBE_TRIES = 3


class _Liveness:
    """Whether a peer's process is still there, asked of the peer itself.

    ``check_collective_ops_peer_health`` is the probe `MultiWorkerMirroredStrategy`'s own health
    thread uses: a peer that has exited answers UnavailableError (or FailedPrecondition once
    restarted). A probe that times out counts as lost only after `_PROBE_TRIES` in a row, so a
    busy peer is not taken for a gone one. Anything else (a TensorFlow without the probe) turns
    it off, and the wait falls back to the timeout.
    """

    def __init__(self) -> None:
        self._on = True
        self._slow: dict[str, int] = {}

    def gone(self, peer: str) -> bool:
        if not self._on:
            return False
        import tensorflow as tf

        from keras_sync.upstream.multi_worker import peer_health

        job, _, index = peer.partition(":")
        try:
            self._on = peer_health(f"/job:{job}/replica:0/task:{index}", _PROBE_MS)
        except (tf.errors.UnavailableError, tf.errors.FailedPreconditionError):
            return True
        except tf.errors.DeadlineExceededError:
            self._slow[peer] = self._slow.get(peer, 0) + 1
            return self._slow[peer] >= _PROBE_TRIES
        except Exception:
            self._on = False
            return False
        self._slow[peer] = 0
        return False


def _name(task: str) -> str:
    job, _, index = task.partition(":")
    return f"{job} {index}"


@contextlib.contextmanager
def collective(model: Any, call: str) -> Iterator[None]:
    """Around one top-level ``call`` of ``model``: meet the peers first, count the call after it.

    Nested calls (fit's validation ``evaluate``) and models not under a multi-worker strategy pass.
    """
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


def meets_peers(model: Any) -> None:
    """Give ``model`` its own ``fit``, ``evaluate`` and ``predict`` that meet the peers first.

    Instance attributes, as `saving.chief_writes_on`: a method the model already has of its own
    (the scope's ``fit`` guard) is wrapped, else the class's. Keras's classes are not changed.
    """
    ref = weakref.ref(model)
    for name in ("fit", "evaluate", "predict"):
        own = vars(model).get(name)
        if not getattr(own, _WRAPPED_MARK, False):
            object.__setattr__(model, name, _meets_peers(ref, name, own))


def _meets_peers(ref: Any, name: str, own: Callable[..., Any] | None) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        model = ref()
        method = own if own is not None else getattr(type(model), name).__get__(model)
        with collective(model, f"model.{name}"):
            return method(*args, **kwargs)

    functools.update_wrapper(wrapper, own if own is not None else getattr(type(ref()), name))
    setattr(wrapper, _WRAPPED_MARK, True)
    return wrapper


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
    from keras_sync.cluster import strategy_role

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
            # this process's TensorFlow teardown would then print pages of heartbeat errors (seen on a
            # loaded machine) or wait for a leader that is gone. Leave at once, code 2 (the job's usage
            # error); atexit handlers registered before keras_sync.load() do not run.
            sys.stdout.flush()
            os._exit(2)
