"""keras_sync.tracking.deliver.Retrier: each request retried alone, a backoff any success resets, the cause in words."""

from __future__ import annotations

from collections import Counter

import pytest

from keras_sync.tracking.deliver import (
    FIRST_BACKOFF_S,
    HEALTHY_AFTER,
    MAX_BACKOFF_S,
    Retrier,
    failure_kind,
    in_words,
)

_503 = (
    "API request to http://h/api/2.0/mlflow/runs/log-batch failed with exception HTTPConnectionPool(host='h', "
    "port=80): Max retries exceeded with url: /api (Caused by ResponseError('too many 503 error responses'))"
)


class _Server:
    """Answers requests from a script of outcomes: an exception to raise, or a value to return."""

    def __init__(self, outcomes: list[object]):
        self.outcomes = list(outcomes)
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        out = self.outcomes.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out


def _retrier(**kw) -> tuple[Retrier, list[float]]:
    slept: list[float] = []
    return Retrier(lambda e: not isinstance(e, ValueError), sleep=slept.append, **kw), slept


@pytest.mark.parametrize(
    "error, kind",
    [
        (Exception(_503), "HTTP 503"),
        (
            Exception(
                "API request to endpoint /x failed with error code 500 != 200. Response body: 'oops'"
            ),
            "HTTP 500",
        ),
        (
            Exception("Failed to establish a new connection: [Errno 111] Connection refused"),
            "connection refused",
        ),
        (
            Exception("API request to http://h failed with timeout exception Read timed out."),
            "a timeout",
        ),
        (
            Exception(
                "('Connection aborted.', RemoteDisconnected('Remote end closed connection'))"
            ),
            "a dropped connection",
        ),
        (OSError("disk I/O error"), "OSError"),
    ],
)
def test_failure_kind_names_what_the_request_met(error, kind):
    assert failure_kind(error) == kind


def test_a_failed_request_is_retried_alone_until_it_succeeds():
    r, slept = _retrier()
    server = _Server([Exception(_503), Exception(_503), "ok"])
    assert r.call(server) == "ok" and server.calls == 3
    assert r.summary() == "2 of 3 requests failed with HTTP 503"
    assert r.failing and not r.unreachable()


def test_any_success_resets_the_backoff():
    r, slept = _retrier()
    r.call(_Server([Exception(_503), Exception(_503), Exception(_503), "ok"]))
    assert sum(slept) == pytest.approx(0.5 + 1 + 2) and r.backoff == 0.0
    slept.clear()
    r.call(_Server([Exception(_503), "ok"]))
    assert sum(slept) == pytest.approx(FIRST_BACKOFF_S)  # the first wait again, not 4 s


def test_backoff_doubles_up_to_its_limit():
    r, slept = _retrier()
    r.call(_Server([Exception(_503)] * 9 + ["ok"]))
    # The waits, summed from their 0.1 s slices: 0.5, 1, 2, 4, 8, 16, 30, 30, 30.
    assert sum(slept) == pytest.approx(0.5 + 1 + 2 + 4 + 8 + 16 + MAX_BACKOFF_S * 3)


def test_a_refusal_is_raised_at_once_and_not_counted():
    r, slept = _retrier()
    server = _Server([ValueError("RESOURCE_DOES_NOT_EXIST")])
    with pytest.raises(ValueError):
        r.call(server)
    assert server.calls == 1 and slept == [] and not r.failing and r.summary() == ""


def test_give_up_raises_the_failure():
    r, _ = _retrier(give_up=lambda: True)
    with pytest.raises(Exception, match="too many 503"):
        r.call(_Server([Exception(_503), "never"]))


def test_unreachable_only_when_no_request_was_answered():
    r, _ = _retrier()
    r.call(_Server([ConnectionRefusedError("Connection refused"), "ok"]))
    assert not r.unreachable()  # answered the retry
    dead, _ = _retrier(give_up=lambda: True)
    with pytest.raises(ConnectionRefusedError):
        dead.call(_Server([ConnectionRefusedError("Connection refused")]))
    assert dead.unreachable() and dead.summary() == "1 of 1 requests failed with connection refused"


def test_the_server_is_healthy_again_after_a_run_of_successes_and_the_counts_restart():
    changes: list[bool] = []
    r, _ = _retrier(on_change=lambda rr: changes.append(rr.failing))
    r.call(_Server([Exception(_503), "ok"]))
    for _ in range(HEALTHY_AFTER - 2):
        r.call(lambda: "ok")
    assert r.failing
    r.call(lambda: "ok")
    assert not r.failing and r.summary() == "" and changes[0] is True and changes[-1] is False


def test_in_words_lists_kinds_most_first():
    assert (
        in_words(40, Counter({"HTTP 500": 5, "HTTP 503": 7}))
        == "12 of 40 requests failed: HTTP 503 (7), HTTP 500 (5)"
    )
