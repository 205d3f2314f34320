"""`keras_sync.tracking.deliver.environ_restored`: variables come back exactly, after an error too."""

from __future__ import annotations

import doctest
import os

import pytest

from keras_sync.tracking import deliver as _env
from keras_sync.tracking.deliver import environ_restored


def test_doctest() -> None:
    assert doctest.testmod(_env).failed == 0


def test_a_set_value_comes_back_and_an_absent_one_stays_absent_after_an_error(monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mine.db")
    monkeypatch.delenv("KS_ABSENT", raising=False)
    with pytest.raises(RuntimeError), environ_restored("MLFLOW_TRACKING_URI", "KS_ABSENT"):
        os.environ["MLFLOW_TRACKING_URI"] = "http://127.0.0.1:1"
        os.environ["KS_ABSENT"] = "x"
        raise RuntimeError("an MLflow call failed")
    assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:///mine.db"
    assert "KS_ABSENT" not in os.environ
