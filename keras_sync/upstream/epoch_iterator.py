"""Keras's epoch iterator, able to start an epoch at a saved step (feature ``exact_resume``):
`fit` builds it from the module global ``TFEpochIterator``, swapped for the length of one `fit`."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

from keras_sync.upstream import internals as _internals
from keras_sync.upstream.patching import original, patched


@contextlib.contextmanager
def resumable_epoch_iterators(made: Callable[[Any], None]) -> Iterator[None]:
    """For this span, every epoch iterator `fit` builds can `resume_at(epoch, step)`; ``made`` gets
    each one."""
    _internals.require("exact_resume")
    trainer: Any = importlib.import_module(_internals.TRAINER)
    base: Any = original(trainer, "TFEpochIterator")

    class ResumableEpochIterator(base):
        """Keras's epoch iterator, plus `resume_at(epoch, step)`: the epochs done are replayed by
        Keras's own `iter()` calls (a seeded shuffle reshuffles as before), then the resumed
        epoch's trained batches are dropped."""

        _ks_resume: tuple[int, int] | None = None

        def resume_at(self, epoch: int, step: int) -> None:
            self._ks_resume = (epoch, step)

        def _enumerate_iterator(self) -> Iterator[tuple[int, int, Any]]:
            point, self._ks_resume = self._ks_resume, None
            if point is None:
                yield from super()._enumerate_iterator()
                return
            epochs_done, step = point
            for _ in range(epochs_done):
                carry_over = self.steps_per_epoch is not None or self._num_batches is None
                with self.catch_stop_iteration():
                    for *_, it in super()._enumerate_iterator():
                        if carry_over:
                            self._drop(it)
            for item in super()._enumerate_iterator():
                # Keras 3.10 yields (step, iterator), later ones (begin, end, iterator).
                end = item[1] if len(item) == 3 else item[0] + self.steps_per_execution - 1
                if end < step:
                    self._drop(item[-1])
                    continue
                yield item

        def _drop(self, it: Any) -> None:
            for _ in range(self.steps_per_execution):
                next(it)

    def make_iterator(*args: Any, **kwargs: Any) -> Any:
        iterator = ResumableEpochIterator(*args, **kwargs)
        made(iterator)
        return iterator

    with patched([(trainer, "TFEpochIterator", make_iterator)]):
        yield


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """The epoch `fit` starts at, read after `on_train_begin` as for Keras's BackupAndRestore."""
    model._initial_epoch = epoch
