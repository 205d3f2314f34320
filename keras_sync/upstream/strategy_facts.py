"""Facts about a strategy that is already built (no TensorFlow import; reads the strategy's own fields).

Here, apart from `keras_sync.strategy` (the factory), so that the modules that only ask about a
built strategy (the Keras fixes, saving, the collectives check, the backup) need not import the
factory, and the factory can import them without a circle.
"""

from __future__ import annotations

from typing import Any


def in_multi_worker_mode(strategy: Any) -> bool:
    """Whether ``strategy`` spans several workers (collectives then need every worker to take part)."""
    check = getattr(getattr(strategy, "extended", None), "_in_multi_worker_mode", None)
    return bool(check()) if check is not None else False
