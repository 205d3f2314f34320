"""Facts about a built strategy (no TensorFlow import), apart from the factory to avoid a circle."""

from __future__ import annotations

from typing import Any


def in_multi_worker_mode(strategy: Any) -> bool:
    """Whether ``strategy`` spans several workers (collectives then need every worker to take part)."""
    check = getattr(getattr(strategy, "extended", None), "_in_multi_worker_mode", None)
    return bool(check()) if check is not None else False
