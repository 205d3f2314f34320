"""`environ_restored`: environment variables put back exactly as they were (set, changed or absent)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def environ_restored(*keys: str) -> Iterator[None]:
    """Inside: change ``keys`` freely. After: each has the value it had, or is absent if it was.

    >>> os.environ.pop("KS_DOCTEST", None)
    >>> with environ_restored("KS_DOCTEST"):
    ...     os.environ["KS_DOCTEST"] = "1"
    >>> "KS_DOCTEST" in os.environ
    False
    """
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
