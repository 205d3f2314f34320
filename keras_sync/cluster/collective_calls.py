"""Every worker at the same collective call, or one line saying which worker is elsewhere.

Under `MultiWorkerMirroredStrategy` ``fit``, ``evaluate`` and ``predict`` are collectives. Before
each top-level call, and at exit after a successful run, each worker posts the call's name in
TensorFlow's coordination service and reads every peer's post. After each call the workers meet
again, as they do before deleting the backups and before a preemption exit: a worker whose last
collective has ended may still serve a buffer a peer is fetching, so none leaves before all are done.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from keras_sync.cluster import strategy_role, training_tasks
from keras_sync.errors import UsageError
from keras_sync.upstream.strategy_facts import built_under

EXIT = "exit"
# While waiting for a peer's post, ask every 2 s whether its process is still there; a probe that
# times out counts as gone only after 3 in a row, so a busy peer is not taken for a gone one.
_POLL_MS, _PROBE_MS, _PROBE_TRIES = 2000, 10_000, 3
_ATTRIBUTE = "_keras_sync_peer_calls"  # the strategy attribute that holds its PeerCalls
_strategies = itertools.count()  # strategies built in this process: alike on every worker


class PeerElsewhereError(UsageError):
    """A peer posted another call than this worker's."""


def _said(call: str) -> str:
    return "reached the end of its script" if call == EXIT else f"called {call}"


class PeerCalls:
    """The collective calls of one multi-worker strategy, numbered alike on every worker."""

    def __init__(self, strategy: Any, timeout_s: float):
        self.strategy, self.timeout_s = strategy, timeout_s
        self._prefix = f"keras_sync/call/{next(_strategies)}"
        self._count = itertools.count()  # next() is atomic: one number per call, in call order
        self.returned, self.failed = 0, False
        self._local = threading.local()  # `inside`: a nested call (validation evaluate) passes

    def meet(
        self,
        call: str,
        on_wait: Callable[[str], None] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Wait until every peer posted this ``call`` under this number; else `UsageError` naming it."""
        import tensorflow as tf

        from keras_sync.upstream import multi_worker

        key = f"{self._prefix}/{next(self._count)}"
        resolver = self.strategy.cluster_resolver
        me = (resolver.task_type, int(resolver.task_id))
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s

        def fail(what: str, error: type[UsageError] = UsageError) -> UsageError:
            return error(
                f"{me[0]} {me[1]} {_said(call)}, but {what}. Under multi_worker_mirrored {call} is a "
                "collective: every worker must call it, in the same order. Fix: take the call out of "
                "`if sync.is_chief:` or any branch only some workers take."
            )

        try:
            multi_worker.set_key(f"{key}/{me[0]}:{me[1]}", call)
        except tf.errors.OpError:  # the coordination service's worker (the chief) has exited
            gone = "the job's coordination service is gone: the worker that hosts it has left"
            raise fail(gone + " the job") from None
        for job, index in training_tasks(resolver.cluster_spec().as_dict()):
            name, slow = f"{job} {index}", 0
            while (job, index) != me:
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                try:
                    got = multi_worker.get_key(f"{key}/{job}:{index}", min(left_ms, _POLL_MS))
                    if got != call:
                        raise fail(f"{name} {_said(got)} instead", PeerElsewhereError)
                    break
                except tf.errors.DeadlineExceededError:
                    if on_wait is not None:
                        on_wait(name)
                        on_wait = None
                    if left_ms <= _POLL_MS:
                        late = f"{name} did not reach that call within strategy.connect_timeout_s"
                        raise fail(f"{late}={timeout_s:g} s") from None
                except tf.errors.OpError as e:
                    why = f"TensorFlow: {type(e).__name__}"
                    if isinstance(e, tf.errors.UnavailableError):
                        why = "TensorFlow can no longer reach it"
                    raise fail(f"{name} has left the job ({why})") from None
                # MultiWorkerMirroredStrategy's own health probe: an exited peer answers Unavailable
                # (FailedPrecondition once restarted).
                try:
                    multi_worker.peer_health(f"/job:{job}/replica:0/task:{index}", _PROBE_MS)
                    slow = 0
                except (tf.errors.UnavailableError, tf.errors.FailedPreconditionError):
                    slow = _PROBE_TRIES
                except tf.errors.DeadlineExceededError:
                    slow += 1
                except Exception:
                    slow = 0
                if slow >= _PROBE_TRIES:
                    raise fail(f"{name} has left the job (its process no longer answers)")

    def all_done(self, what: str, timeout_s: float | None = None) -> bool:
        """Every peer is done with ``what`` (posted it), or False, silently: one is gone or late.
        The caller goes on either way; a gone peer reports its own failure."""
        try:
            self.meet(what, timeout_s=timeout_s)
            return True
        except UsageError:
            return False

    def meet_at_exit(self) -> None:
        """The exit meeting, after a successful run only."""
        if not self.returned or self.failed or getattr(sys, "last_value", None) is not None:
            return

        def say(peer: str) -> None:
            why = "the workers leave together; closing TensorFlow's input pipeline can take seconds"
            print(f"keras-sync: waiting for {peer} to finish its script ({why})", file=sys.stderr)

        try:
            self.meet(EXIT, on_wait=say if strategy_role(self.strategy).is_chief else None)
        except UsageError as e:
            # A peer is in another call: that worker reports it; this one leaves with one line.
            print(f"keras-sync: {str(e).split('. Under')[0]}.", file=sys.stderr, flush=True)
            if isinstance(e, PeerElsewhereError):
                # The peer fails now, maybe taking the coordination service with it: TensorFlow's
                # teardown would print pages of errors. Leave at once with the usage-error code 2.
                sys.stdout.flush()
                os._exit(2)


def peer_calls(strategy: Any) -> PeerCalls | None:
    """The `PeerCalls` of a multi-worker strategy keras_sync built; None for any other."""
    return getattr(strategy, _ATTRIBUTE, None)


def configure(strategy: Any, timeout_s: float) -> None:
    """Give a multi-worker strategy keras_sync built its `PeerCalls` and the exit meeting."""
    calls = PeerCalls(strategy, timeout_s)
    setattr(strategy, _ATTRIBUTE, calls)
    atexit.register(calls.meet_at_exit)


@contextlib.contextmanager
def collective(model: Any, call: str) -> Iterator[None]:
    """Around one top-level ``call`` of ``model``: meet the peers first, count the call after it."""
    calls = peer_calls(built_under(model))
    if calls is None or getattr(calls._local, "inside", False):
        yield
        return
    calls.meet(call)
    calls._local.inside = True
    try:
        yield
    except BaseException:
        calls.failed = True  # peers may still be inside this collective: no exit meeting
        raise
    finally:
        calls._local.inside = False
    calls.returned += 1
    calls.all_done(f"the end of {call}")
