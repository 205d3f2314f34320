"""Under several workers the chief alone writes, and every worker meets the others.

TensorFlow's recipe: every worker saves (a read can be a collective), the chief to the real path,
the others to a temporary directory deleted at once. ``keras.saving.save_model`` and callbacks
keras-sync does not know write on every worker: guard them with ``sync.is_chief``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from keras_sync.cluster import strategy_role
from keras_sync.errors import UsageError

TEMP_PREFIX = "keras_sync_worker_save_"


def wrap_own(model: Any, name: str, around: Callable[..., Any], mark: str) -> None:
    """Give ``model`` its own ``name``: ``around(call, *args, **kwargs)``, ``call`` the method it
    has now; once per ``mark``."""
    own = vars(model).get(name)
    if getattr(own, mark, False):
        return
    ref = weakref.ref(model)

    @functools.wraps(own or getattr(type(model), name))
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        call = own or getattr(type(ref()), name).__get__(ref())
        return around(call, *args, **kwargs)

    setattr(wrapper, mark, True)  # functools.wraps copied the marks of the wrapped one
    object.__setattr__(model, name, wrapper)  # a function is not state for Keras's tracker


def for_workers(model: Any) -> None:
    """``save``/``save_weights`` write on the chief only, ``fit``/``evaluate``/``predict`` meet peers."""
    from keras_sync.cluster.collective_calls import collective

    strategy, ref = model.distribute_strategy, weakref.ref(model)

    def chief_writes(call: Callable[..., Any], filepath: Any, *args: Any, **kwargs: Any) -> Any:
        with write_target(filepath, strategy) as target:
            return call(target, *args, **kwargs)

    def meeting(name: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with collective(ref(), f"model.{name}"):
            return call(*args, **kwargs)

    for name in ("save", "save_weights"):
        wrap_own(model, name, chief_writes, "_keras_sync_chief_writes")
    for name in ("fit", "evaluate", "predict"):
        wrap_own(model, name, functools.partial(meeting, name), "_keras_sync_meets_peers")


@contextlib.contextmanager
def write_target(filepath: Any, strategy: Any) -> Iterator[Any]:
    """``filepath`` on the chief, else a temporary file of the same name, deleted after the block."""
    if strategy is None or strategy_role(strategy).is_chief:
        yield filepath
        return
    tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    try:
        yield os.path.join(tmp, os.path.basename(os.fspath(filepath).rstrip("/")) or "model.keras")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save(model: Any, filepath: Any, **kwargs: Any) -> None:
    """Save ``model`` (``*.weights.h5``: its weights) from every worker; the chief to ``filepath``."""
    if not hasattr(model, "save") or not hasattr(model, "save_weights"):
        msg = f"Invalid value for argument `model` of sync.save. Received: {type(model).__name__}. Expected a Keras model."
        raise UsageError(msg)
    if not isinstance(filepath, (str, os.PathLike)) or not os.fspath(filepath):
        msg = f"Invalid value for argument `filepath` of sync.save. Received: filepath={filepath!r}. Expected a path such as 'model.keras' or 'model.weights.h5'."
        raise UsageError(msg)
    name = "save_weights" if os.fspath(filepath).endswith(".weights.h5") else "save"
    with write_target(filepath, getattr(model, "distribute_strategy", None)) as target:
        getattr(type(model), name)(model, target, **kwargs)


#: Keras callbacks that write files, and the attribute of the user's path (a temporary one elsewhere).
USER_PATH_ATTRS = (("TensorBoard", "log_dir"), ("CSVLogger", "filename"))


def guard_callbacks(strategy: Any, callbacks: list[Any]) -> list[Any]:
    """``callbacks``, Keras's among them writing the user's paths on the chief only (else temporary)."""
    if strategy_role(strategy).is_chief:
        return callbacks
    import keras

    from keras_sync.upstream.backup_and_restore import non_chief_backup

    for cb in callbacks:
        if type(cb) is keras.callbacks.BackupAndRestore:  # a subclass may save differently
            non_chief_backup(cb)
        for class_name, attr in USER_PATH_ATTRS:
            if isinstance(cb, getattr(keras.callbacks, class_name)):
                # A callback reused: its user's path is the one kept from the first time.
                user_path = vars(cb).setdefault("_keras_sync_user_path", getattr(cb, attr))
                tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX)
                name = os.path.basename(os.fspath(user_path).rstrip("/")) or "logs"
                setattr(cb, attr, os.path.join(tmp, name))
                cb.on_train_end = functools.partial(_train_end_then_delete, cb, tmp)
    return callbacks


def _train_end_then_delete(cb: Any, tmp: str, logs: Any = None) -> None:
    try:
        type(cb).on_train_end(cb, logs)  # closes the file or the event writers first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
