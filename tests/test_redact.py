"""Secrets never leave: URI credentials and secret-looking environment values are scrubbed."""

from __future__ import annotations

import doctest
import random
import re
import time

import pytest

from keras_sync.tracking import redact


def test_doctests():
    assert doctest.testmod(redact).failed == 0


def test_secrets_from_uri_and_env_longest_first():
    got = redact.secrets_of(
        "http://alice:pa55word@127.0.0.1:5000/?token=tok-123",
        {
            "MLFLOW_TRACKING_TOKEN": "abcdef",
            "HOME": "/root",
            "MY_API_KEY": "k3y-long-value",
            "SOME_PASSWORD": "true",
        },
    )
    assert got == ["k3y-long-value", "pa55word", "tok-123", "abcdef"]


def test_redact_text_scrubs_every_secret_and_credentials():
    secrets = redact.secrets_of("https://bob:hunter22@mlflow.example/", {"GH_TOKEN": "ghp_xyz"})
    text = "failed https://bob:hunter22@mlflow.example/api with ghp_xyz and hunter22"
    assert redact.redact_text(text, secrets) == "failed https://mlflow.example/api with *** and ***"


# The patterns redact.py applied before it scanned from anchors: the definition of what it
# matches. They take time quadratic in the text (84 s on 200,000 letters), so only short texts.
_USERINFO_REGEX = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#@\s]*@")
_SECRET_QUERY_REGEX = re.compile(
    r"(?P<key>[?&;][^=&#\s]*(?:token|password|passwd|secret|key|sig|signature|credential|auth)"
    r"[^=&#\s]*=)[^&#;\s]*",
    re.IGNORECASE,
)


def _redact_by_regex(uri: str) -> str:
    uri = _USERINFO_REGEX.sub(lambda m: m.group("scheme"), uri)
    return _SECRET_QUERY_REGEX.sub(lambda m: m.group("key") + "***", uri)


def test_redact_uri_matches_what_the_regexes_define():
    parts = [
        "a",
        "Z",
        "1",
        "+",
        ".",
        "-",
        ":",
        "/",
        "://",
        "@",
        "?",
        "&",
        ";",
        "=",
        "#",
        " ",
        "\n",
        "TOKEN",
        "key",
        "sig",
        "é",
        "x:p@",
    ]
    rng = random.Random(42)
    for _ in range(20_000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 14)))
        assert redact.redact_uri(text) == _redact_by_regex(text), text
        want = {text[q.end("key") : q.end()] for q in _SECRET_QUERY_REGEX.finditer(text)}
        assert {s for s in redact.secrets_of(text, {}) if s in want} == {
            s for s in want if len(s) >= 3
        }, text


@pytest.mark.parametrize(
    "text",
    [
        "a" * 200_000,  # a scheme that never ends in ://
        "?" * 200_000,  # a query key that never ends in =
        ";token" * 33_000,  # a secret word that is never a key
        "a://" * 50_000,  # a scheme with no credentials, many times
        "a" * 100_000 + "://" + "b" * 100_000,
    ],
    ids=["letters", "question_marks", "secret_words", "schemes", "one_long_uri"],
)
def test_redact_takes_linear_time_on_long_values(text):
    # A user's value (run name, param, error message) goes through redact_uri; the regexes above
    # took 84 s for 200,000 letters on this machine. 1 s is ~30 times the time taken now.
    started = time.perf_counter()
    redact.redact_uri(text)
    redact.secrets_of(text, {})
    assert time.perf_counter() - started < 1.0
