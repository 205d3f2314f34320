"""Secrets never leave: URI credentials and secret-looking environment values are scrubbed."""

from __future__ import annotations

import doctest

from keras_sync.tracking import redact


def test_doctests():
    assert doctest.testmod(redact).failed == 0


def test_secrets_from_uri_and_env_longest_first():
    got = redact.secrets_of("http://alice:pa55word@127.0.0.1:5000/?token=tok-123",
                            {"MLFLOW_TRACKING_TOKEN": "abcdef", "HOME": "/root", "MY_API_KEY": "k3y-long-value",
                             "SOME_PASSWORD": "true"})
    assert got == ["k3y-long-value", "pa55word", "tok-123", "abcdef"]


def test_redact_text_scrubs_every_secret_and_credentials():
    secrets = redact.secrets_of("https://bob:hunter22@mlflow.example/", {"GH_TOKEN": "ghp_xyz"})
    text = "failed https://bob:hunter22@mlflow.example/api with ghp_xyz and hunter22"
    assert redact.redact_text(text, secrets) == "failed https://mlflow.example/api with *** and ***"
