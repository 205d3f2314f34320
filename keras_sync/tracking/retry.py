"""Retry one MLflow request at a time, and say what happened to the requests in words.

The courier and ``keras-sync sync-spool`` send a spool as many small requests (find the run, params,
text artifacts, batches of points). A server that fails some of them (an overloaded gateway answering
HTTP 503) still takes the others: each request is retried on its own, with a wait that doubles from
`FIRST_BACKOFF_S` up to `MAX_BACKOFF_S` and starts again from nothing after any success, so delivery
moves on as long as any request gets through. MLflow's own client retries are turned off for these
calls (`keras_sync.tracking.deliver.fast_fail_env`): one policy, ours, decides.

What happened since the requests started failing is kept by kind (``HTTP 503``, ``connection refused``)
for the cause a person reads: "7 of 40 requests failed with HTTP 503", not "unreachable".
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: The first wait before a failed request is sent again (seconds); it doubles on each failure in a row.
FIRST_BACKOFF_S = 0.5
#: The longest wait between two tries of one request (seconds).
MAX_BACKOFF_S = 30.0
#: After a failure, this many successes in a row make the server healthy again (the cause is cleared).
HEALTHY_AFTER = 20
#: Kinds of failure that mean the server did not answer at all.
NO_ANSWER = ("connection refused", "a timeout", "a dropped connection")

_HTTP = (
    re.compile(r"too many (\d{3}) error responses"),
    re.compile(r"failed with error code (\d{3})"),
    re.compile(r"\bHTTP (\d{3})\b"),
)


def failure_kind(exc: BaseException) -> str:
    """What a failed request met, in a few words.

    >>> failure_kind(Exception("API request to http://h/api failed with exception HTTPConnectionPool(...): "
    ...                        "Max retries exceeded (Caused by ResponseError('too many 503 error responses'))"))
    'HTTP 503'
    >>> failure_kind(ConnectionRefusedError("[Errno 111] Connection refused"))
    'connection refused'
    """
    text = str(exc)
    for pattern in _HTTP:
        m = pattern.search(text)
        if m:
            return f"HTTP {m.group(1)}"
    low = text.lower()
    if "connection refused" in low or "failed to establish a new connection" in low:
        return "connection refused"
    if "timeout" in low or "timed out" in low:
        return "a timeout"
    if "connection aborted" in low or "remotedisconnected" in low or "connection reset" in low:
        return "a dropped connection"
    code = getattr(exc, "error_code", None)
    return str(code) if code else type(exc).__name__


def in_words(requests: int, failures: Counter[str]) -> str:
    """``"7 of 40 requests failed with HTTP 503"``; several kinds, most first, each with its count.

    >>> in_words(40, Counter({"HTTP 503": 7}))
    '7 of 40 requests failed with HTTP 503'
    >>> in_words(40, Counter({"HTTP 503": 7, "HTTP 500": 5}))
    '12 of 40 requests failed: HTTP 503 (7), HTTP 500 (5)'
    """
    n = sum(failures.values())
    if len(failures) == 1:
        return f"{n} of {requests} requests failed with {next(iter(failures))}"
    kinds = ", ".join(f"{kind} ({count})" for kind, count in failures.most_common())
    return f"{n} of {requests} requests failed: {kinds}"


class Retrier:
    """Sends requests through `call`, retrying each transient failure until it succeeds or `give_up` says stop.

    Args:
        transient: whether a failed request may succeed later (else it is raised at once).
        give_up: asked after each failure and while waiting; True raises the failure.
        on_change: called after every failure, after every success while requests fail lately (the
            time of the last answer changed), and when the server is healthy again (`HEALTHY_AFTER`).
    """

    def __init__(
        self,
        transient: Callable[[BaseException], bool],
        *,
        give_up: Callable[[], bool] = lambda: False,
        on_change: Callable[[Retrier], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.transient, self.give_up, self.on_change, self._sleep = (
            transient,
            give_up,
            on_change,
            sleep,
        )
        self.backoff = 0.0
        self.requests = 0  # since the first failure of this episode (or since the start)
        self.failures: Counter[str] = Counter()
        self.succeeded_in_a_row = 0
        self.failing_since: float | None = None  # wall time of the episode's first failure
        self.answered_at: float | None = None  # wall time of the last success
        self.last_error: BaseException | None = None
        self.total_requests = self.total_failures = 0

    @property
    def failing(self) -> bool:
        """Whether requests failed lately (fewer than `HEALTHY_AFTER` successes in a row since)."""
        return self.failing_since is not None

    def unreachable(self) -> bool:
        """Whether every request of this episode failed without an answer from the server."""
        return (
            self.failing
            and set(self.failures) <= set(NO_ANSWER)
            and self.requests == sum(self.failures.values())
        )

    def summary(self) -> str:
        """What happened to the requests since they started failing, in words ("" while healthy)."""
        return in_words(self.requests, self.failures) if self.failures else ""

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        while True:
            self.requests += 1
            self.total_requests += 1
            try:
                result = fn(*args, **kwargs)
            except Exception as e:
                if not self.transient(e):
                    self.requests -= 1  # a refusal is not this policy's to count or retry
                    self.total_requests -= 1
                    raise
                self._failed(e)
                if self.give_up() or not self._wait():
                    raise
                continue
            self._succeeded()
            return result

    def _failed(self, exc: BaseException) -> None:
        self.total_failures += 1
        self.last_error = exc
        if self.failing_since is None:
            self.failing_since = time.time()
            self.requests = 1
        self.failures[failure_kind(exc)] += 1
        self.succeeded_in_a_row = 0
        self.backoff = min(max(self.backoff * 2, FIRST_BACKOFF_S), MAX_BACKOFF_S)
        if self.on_change is not None:
            self.on_change(self)

    def _succeeded(self) -> None:
        self.backoff = 0.0
        self.answered_at = time.time()
        self.succeeded_in_a_row += 1
        if not self.failing:
            return
        if self.succeeded_in_a_row >= HEALTHY_AFTER:
            self.failing_since, self.failures, self.requests = None, Counter(), 0
        if self.on_change is not None:
            self.on_change(self)

    def _wait(self) -> bool:
        """Sleep the backoff in short slices; False if `give_up` said stop meanwhile."""
        left = self.backoff
        while left > 1e-9:
            self._sleep(min(left, 0.1))
            left -= 0.1
            if self.give_up():
                return False
        return True
