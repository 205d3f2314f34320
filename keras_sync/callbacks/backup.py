"""Back up the training state and resume exactly where a killed job stopped, mid-epoch included
(Keras's own `BackupAndRestore` restarts an interrupted epoch at batch 0)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import keras

from keras_sync.cluster import strategy_role
from keras_sync.cluster.collective_calls import peer_calls
from keras_sync.errors import UsageError
from keras_sync.training import backup_files as files
from keras_sync.upstream.epoch_iterator import set_initial_epoch
from keras_sync.upstream.strategy_facts import in_multi_worker_mode


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class BackupAndRestore(keras.callbacks.Callback):
    """Back up the training state every epoch or every N batches; restore it when `fit` restarts.

    Saved with `tf.train.Checkpoint`: the model, its optimizer, the running epoch's metrics, the
    random-seed states and the position (epoch, batches trained in it), restored in
    ``on_train_begin`` (put this callback first); `Sync.fit` then skips the batches already trained,
    a plain `model.fit` restarts the epoch at batch 0, as Keras does. Every worker saves (reading
    the variables is collective); only the chief writes ``backup_dir``, on storage all share.

    Args:
        backup_dir: directory for the checkpoints; not shared with anything else.
        save_freq: ``"epoch"``, or an integer: save every that many batches.
        delete_checkpoint: delete the backup when training finishes. Defaults to True.
        max_to_keep: checkpoints kept (the newest), at least 2: a damaged newest one is skipped on
            restore for the one before. Defaults to 2.
        grace_period_s: a SIGTERM (or Ctrl-C) during `fit` saves a backup at the current step on
            every worker, then exits with code 143 (130), or without it after this many seconds.
            None: both signals are left alone. Defaults to 25.
        writer: the MLflow writer whose queued metrics are spooled before each save, and whose run
            each backup records.
        shared: the `keras_sync.callbacks.SharedState` of this fit's keras-sync callbacks, flushed
            before each save.

    Example:
        >>> sync = keras_sync.load({"fault_tolerance": {"backup_dir": "/tmp/bk", "save_freq": 50}})  # doctest: +SKIP
        >>> sync.fit(model, x, y, epochs=5)  # adds this callback; rerun after a kill to resume  # doctest: +SKIP
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int = "epoch",
        *,
        delete_checkpoint: bool = True,
        max_to_keep: int = 2,
        grace_period_s: float | None = 25.0,
        writer: Any = None,
        shared: Any = None,
    ):
        super().__init__()
        from keras_sync.cluster.preemption import PreemptionSaver
        from keras_sync.training.context import check_shared

        if not backup_dir or not isinstance(backup_dir, (str, os.PathLike)):
            msg = f"Invalid value for argument `backup_dir`. Received: backup_dir={backup_dir!r}. Expected the path of a directory used for nothing else."
            raise UsageError(msg)
        seconds = isinstance(grace_period_s, (int, float)) and not isinstance(grace_period_s, bool)
        if grace_period_s is not None and not (seconds and grace_period_s > 0):
            msg = f"Invalid value for argument `grace_period_s`. Received: grace_period_s={grace_period_s!r}. Expected a number of seconds > 0, or None to leave SIGTERM alone."
            raise UsageError(msg)
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self._schedule = files.SaveSchedule(save_freq)
        self.delete_checkpoint = delete_checkpoint
        self.max_to_keep = max_to_keep
        self._preemption = PreemptionSaver(grace_period_s) if grace_period_s is not None else None
        self.writer = writer
        self.shared = check_shared(shared)
        #: Where this fit's restore continued (None: it started fresh); the resume check reads it.
        self.restored: files.ResumePoint | None = None
        self.choice: files.Choice | None = None  # chosen before fit by `backup_callbacks`
        self.lock: files.BackupLock | None = None  # held on backup_dir for this fit
        self.epoch_iterator: Any = None  # fit's training iterator, set by `resumable_fit`
        self._failed_save: str | None = None  # the cause of the last refused save, until one works

    def on_train_begin(self, logs: Any = None) -> None:
        import tensorflow as tf

        model, strategy = self.model, self.model.distribute_strategy
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # its variables must exist to restore
        self._position = tf.Variable([0, 0], dtype=tf.int64, trainable=False)
        # `SharedState.step_offset`, so a resumed fit logs at its old steps; restored on its own.
        self._step_offset = tf.Variable(-1, dtype=tf.int64, trainable=False)
        weights = {id(w) for w in model.weights}
        self._state = dict(
            model=model,
            optimizer=model.optimizer,
            position=self._position,
            metrics=list(model.metrics_variables),
            # Seed-generator states (Dropout...): not reached through the model's checkpoint.
            random=[v for v in model.variables if id(v) not in weights],
        )
        self._saved = tf.train.Checkpoint(**self._state, step_offset=self._step_offset)
        role = strategy_role(strategy)
        self._is_chief = role.is_chief
        self._dir = files.write_dir(self.backup_dir, is_chief=role.is_chief, task_id=role.task_id)
        self._calls = peer_calls(strategy) if in_multi_worker_mode(strategy) else None
        self.restored, self._resume_line, self._restore_metrics_from = None, None, None
        self._epoch = self._step = 0
        self._deferred = False  # a scheduled save waits for gradient accumulation's next update
        if self._preemption is not None:
            self._preemption.begin(strategy)
        prefix = self._restore(self.choice or files.choose(self.backup_dir))
        self.choice = None
        #: The optimizer step of the newest complete backup, said when a save fails.
        self._newest = None if prefix is None else files.number_of(prefix)
        if prefix is None:
            return
        epoch, step = (int(v) for v in self._position.numpy())
        self.restored = point = files.ResumePoint(epoch, step, self._iterations())
        set_initial_epoch(model, epoch)
        self._epoch, self._step = epoch, step
        if self.epoch_iterator is not None:
            spe = int(getattr(model, "steps_per_execution", 1) or 1)
            self.epoch_iterator.resume_at(epoch, files.batches_to_skip(point, spe))
            self._restore_metrics_from = prefix if point.mid_epoch else None
        # Said once every callback's on_train_begin has run and the restored state is seen to hold.
        self._resume_line = f"keras-sync: resumed from the backup in {self.backup_dir}: epoch {epoch + 1}, after batch {step} (optimizer step {point.iterations})"

    def _restore(self, choice: files.Choice) -> str | None:
        """Restore the newest complete checkpoint TensorFlow reads back; its prefix, or None."""
        import tensorflow as tf

        skipped, found = list(choice.skipped), None
        for prefix in choice.usable:
            try:
                status = tf.train.Checkpoint(**self._state).read(prefix)
                status.assert_existing_objects_matched().expect_partial()
            except (tf.errors.OpError, ValueError, AssertionError) as e:
                skipped.append((prefix, f"TensorFlow cannot read it back: {type(e).__name__}"))
                continue
            tf.train.Checkpoint(step_offset=self._step_offset).read(prefix).expect_partial()
            self.shared.step_offset = max(int(self._step_offset.numpy()), 0)
            found = prefix
            break
        files.refuse_damaged(self.backup_dir, [found] if found else [], skipped)
        instead = f"using {os.path.basename(found)}" if found else "no earlier complete backup"
        for prefix, why in skipped if self._is_chief else ():
            _say(f"keras-sync: skipped the backup {prefix} ({why}); {instead}")
        return found

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._check_restored_state_held(epoch)
        self._epoch, self._step = epoch, (self._step if epoch == self._epoch else 0)
        if self._restore_metrics_from is not None:
            # Keras resets the metrics just before this hook: bring back the interrupted epoch's totals.
            import tensorflow as tf

            metrics = tf.train.Checkpoint(metrics=list(self.model.metrics_variables))
            metrics.read(self._restore_metrics_from).expect_partial()
            self._restore_metrics_from = None

    def _check_restored_state_held(self, epoch: int | None = None) -> None:
        """Once after a restore: no other callback changed the restored epoch or optimizer step."""
        line, self._resume_line = self._resume_line, None
        if line is None or (point := self.restored) is None:
            return
        now, what = self._iterations(), ""
        if now != point.iterations:
            what = f"optimizer step {point.iterations}, but another callback changed it to {now}"
        elif epoch is not None and epoch != point.epoch:
            what = f"epoch {point.epoch + 1}, but another callback changed it to epoch {epoch + 1}"
        if what:
            msg = f"keras-sync's backup in {self.backup_dir} restored {what} before training resumed. Fix: keep one backup: remove the callback that changed it, or remove fault_tolerance.backup_dir."
            raise UsageError(msg)
        if self._is_chief:
            _say(line)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        done, self._step = batch + 1 - self._step, batch + 1
        due = self._preemption is not None and self._preemption.save_due(self._iterations)
        self._save_if(self._schedule.after_batch(max(done, 1)), due)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._epoch, self._step = epoch + 1, 0
        p = self._preemption
        preempted = p is not None and p.save_due_at_epoch_end(self._iterations)
        self._save_if(self._schedule.after_epoch(), preempted)

    def _save_if(self, scheduled: bool, preempted: bool) -> None:
        from keras_sync.training.instrument import holds_unapplied_gradients

        scheduled = scheduled or self._deferred
        if (scheduled or preempted) and holds_unapplied_gradients(self.model):
            # A backup between accumulated updates would lose the sums: saved at the next update.
            self._deferred = scheduled
            return
        self._deferred = False
        saved = (scheduled or preempted) and self._save()
        if preempted:
            self._exit_preempted(saved)

    def _iterations(self) -> int:
        optimizer = self.model.optimizer  # None after compile(optimizer=None) and an own train_step
        return int(optimizer.iterations.numpy()) if optimizer is not None else 0

    def _save(self) -> bool:
        """Back up now, on every worker (reading the variables is collective); False if refused."""
        import tensorflow as tf

        self.shared.flush()
        writer = self.writer
        if writer is not None and hasattr(writer, "flush_to_spool"):  # optional in the protocol
            writer.flush_to_spool(timeout_s=10.0)  # the steps the backup holds are logged first
        self._position.assign([self._epoch, self._step])
        self._step_offset.assign(self.shared.step_offset or 0)  # fixed by SyncMetrics' first step
        number = self._iterations()
        prefix = os.path.join(self._dir, f"ckpt-{number}")
        with contextlib.suppress(OSError):  # a manifest of this number from before a fall-back
            os.unlink(prefix + files.MANIFEST_SUFFIX)
        try:
            os.makedirs(self._dir, exist_ok=True)
            self._saved.write(prefix)
            if self._is_chief:
                run = writer and {  # a relaunch that restores this backup continues the run
                    "job_id": writer.job_id,
                    "explicit": writer.job_id_explicit,
                    "run_id": writer.run_id,
                }
                files.write_manifest(prefix, run)
                files.prune(self._dir, number, max(self.max_to_keep, 2))
        except (tf.errors.OpError, OSError) as e:  # a full or unwritable disk: older backups hold
            # TensorFlow's "...; No space left on device [Op:SaveV2]"
            said = str(getattr(e, "message", e)).split(" [Op:", 1)[0].rsplit("; ", 1)[-1].strip()
            self._save_failed(number, getattr(e, "strerror", None) or said or type(e).__name__)
            return False
        finally:
            for temp in glob.glob(os.path.join(self._dir, "ckpt-*_temp")):  # half-written
                shutil.rmtree(temp, ignore_errors=True)
            if not self._is_chief:
                shutil.rmtree(self._dir, ignore_errors=True)
        self._failed_save, self._newest = None, number
        return True

    def _save_failed(self, number: int, cause: str) -> None:
        """One line per cause for a save the disk refused; training goes on with the older backups."""
        if not self._is_chief or self._failed_save == cause:
            return
        self._failed_save = cause
        resume = "there is no backup to resume from yet"
        if self._newest is not None:
            resume = f"a relaunch resumes from the newest backup, optimizer step {self._newest}"
        msg = f"keras-sync: the backup at optimizer step {number} could not be written to {self.backup_dir} ({cause}); training goes on, and {resume}. Fix: free space there, or set fault_tolerance.backup_dir to a writable folder on a disk with room."
        _say(msg)

    def _exit_preempted(self, saved: bool) -> None:
        """After the coordinated save: every worker waits for the others, then exits (143 or 130)."""
        from keras_sync.cluster.preemption import exit_code, exit_now, signal_name

        assert self._preemption is not None
        self._preemption.leave_together()  # none leaves while another still takes part in the save
        self._preemption.done()
        name, code = signal_name(self._preemption.signum), exit_code(self._preemption.signum)
        where = f"optimizer step {self._newest}" if self._newest is not None else "the start"
        message = f"{name}: the backup at optimizer step {self._iterations()} could not be written (said above); exiting with code {code}. A relaunch resumes from {where}."
        if saved:
            message = f"{name}: saved a backup in {self.backup_dir} at epoch {self._epoch + 1}, after batch {self._step} (optimizer step {self._iterations()}); exiting with code {code}. Relaunch the job to resume from there."
        exit_now(code, message if self._is_chief else None)

    def on_train_end(self, logs: Any = None) -> None:
        self._check_restored_state_held()  # restored after the last epoch: no epoch began
        set_initial_epoch(self.model, None)
        if self._preemption is not None:
            self._preemption.end()
        # Every worker saves at the last epoch end: the chief deletes once all have written, and
        # keeps the backups if a worker is gone or late.
        if self.delete_checkpoint:
            all_saved = self._calls is None or self._calls.all_done("the deletion of the backups")
            if all_saved and self._is_chief:
                shutil.rmtree(self.backup_dir, ignore_errors=True)


@contextlib.contextmanager
def resumable_fit(callbacks: list[Any]) -> Iterator[None]:
    """One `model.fit` whose epoch iterator can resume mid-epoch, when ``callbacks`` hold a backup."""
    backup = next((c for c in callbacks if isinstance(c, BackupAndRestore)), None)
    if backup is None:
        yield
        return
    from keras_sync.upstream.epoch_iterator import resumable_epoch_iterators

    def made(iterator: Any) -> None:
        if backup.epoch_iterator is None:  # fit builds training's iterator first, then validation's
            backup.epoch_iterator = iterator

    try:
        with resumable_epoch_iterators(made):
            yield
    finally:
        backup.epoch_iterator = None
        if backup.lock is not None:
            backup.lock.release()
            backup.lock = None
        if backup._preemption is not None:  # a fit that raised: SIGTERM and SIGINT as before
            backup._preemption.end(clean=False)


def refuse_keras_backup(backup_dir: str | None, callbacks: Any, method: str = "fit") -> None:
    """Refuse Keras's `BackupAndRestore` beside ``fault_tolerance.backup_dir`` (both would restore)."""
    theirs = [cb for cb in callbacks or () if isinstance(cb, keras.callbacks.BackupAndRestore)]
    if backup_dir and theirs:
        msg = f"callbacks of sync.{method}: keras.callbacks.BackupAndRestore({theirs[0].backup_dir!r}) cannot run beside keras-sync's own backup (fault_tolerance.backup_dir: {backup_dir!r}). Fix: remove keras.callbacks.BackupAndRestore from callbacks, or remove fault_tolerance.backup_dir to keep Keras's."
        raise UsageError(msg)


def backup_callbacks(
    context: Any, strategy: Any, *, open_writer: Callable[[], Any], shared: Any = None
) -> list[Any]:
    """The backup ``fault_tolerance.backup_dir`` asks for, its directory locked, its restore chosen."""
    ft = context.config.fault_tolerance
    if not ft.backup_dir:
        return []
    choice = files.choose(ft.backup_dir)
    resolver = getattr(strategy, "cluster_resolver", None)
    cluster = None
    if resolver is not None and context.num_workers > 1:
        cluster = json.dumps(resolver.cluster_spec().as_dict(), sort_keys=True)
    me = files.Holder(context.config.mlflow.job_id, socket.gethostname(), os.getpid(), cluster)
    lock = None
    if context.is_chief:
        lock = files.BackupLock(ft.backup_dir, me)
        lock.acquire()
    elif (other := files.live_other(files.read_lock(ft.backup_dir), me, chief=False)) is not None:
        raise files.refused(ft.backup_dir, other)
    writer = open_writer() if context.config.mlflow.enabled else None
    backup = BackupAndRestore(
        ft.backup_dir, ft.save_freq, grace_period_s=ft.grace_period_s, writer=writer, shared=shared
    )
    backup.choice, backup.lock = choice, lock
    return [backup]
