"""Keras callbacks that keras-sync adds to `Sync.fit`, and the public ones users can add themselves."""

from __future__ import annotations

from typing import Any


def default_callbacks(sync: Any, model: Any, user_callbacks: Any) -> list[Any]:
    """The user's callbacks plus the ones the config asks for (sync metrics, backup and restore)."""
    callbacks = list(user_callbacks or [])
    return callbacks
