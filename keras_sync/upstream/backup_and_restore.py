"""Keras's `BackupAndRestore` on a worker that is not the chief (feature ``keras_backup_guard``):
no public option keeps it from saving in `_save_model` and deleting ``backup_dir`` at the end."""

from __future__ import annotations

from typing import Any

from keras_sync.upstream import internals as _internals


def non_chief_backup(cb: Any) -> None:
    """``cb`` saves only to its own weights file and deletes nothing at the end of training."""
    _internals.require("keras_backup_guard")
    cb._save_model = lambda: cb.model.save_weights(cb._weights_path, overwrite=True)
    cb.on_train_end = lambda logs=None: None
