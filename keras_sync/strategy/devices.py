"""Device names read one way: ``"/job:localhost/replica:0/task:0/device:CPU:1"``, ``"/cpu:1"``,
``"cpu:1"`` and ``"CPU:1"`` all name ``"CPU:1"`` (where a user's device list meets TensorFlow's)."""

from __future__ import annotations

from keras_sync.errors import StrategyError


def canonical(name: str, *, where: str) -> str:
    """``"TYPE:index"`` for any spelling TensorFlow accepts; else `StrategyError` naming ``where``,
    the key or argument the name came from (``"strategy.devices"``)."""
    import tensorflow as tf

    text = name.strip() if isinstance(name, str) else name
    try:
        # "CPU:1" alone is not a device spec; "/device:CPU:1" is ("/cpu:1" is TensorFlow's legacy form).
        spec = tf.DeviceSpec.from_string(
            text if "/" in text or ":" not in text else f"/device:{text}"
        )
    except (ValueError, TypeError):
        raise StrategyError(
            f"Invalid device name in {where}. Received: {name!r}. "
            'Expected names such as "CPU:0" or "/device:GPU:1".'
        ) from None
    if not spec.device_type or spec.device_index is None:
        raise StrategyError(
            f"Invalid device name in {where}. Received: {name!r}. "
            'Expected a type and an index, such as "CPU:0" or "GPU:1".'
        )
    return f"{spec.device_type.upper()}:{spec.device_index}"
