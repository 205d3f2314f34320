"""Attributes of Keras and TensorFlow replaced for the length of a block, and put back after it.
Spans may nest and run in several threads: the first sets the replacement, the last one to
leave puts the original back."""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterable, Iterator
from typing import Any

#: (owner, attribute name, replacement): a class, module or instance attribute to replace.
Patch = tuple[Any, str, Any]

_MISSING = object()
_lock = threading.RLock()
#: (id(owner), name) -> [spans inside, owner, what the owner itself held before (or _MISSING)].
_held: dict[tuple[int, str], list[Any]] = {}


def _set(owner: Any, name: str, value: Any) -> None:
    """Set ``owner.name`` (delete it for _MISSING); on a Keras object a plain, untracked attribute."""
    plain = isinstance(owner, (type, types.ModuleType))
    if value is _MISSING:
        (delattr if plain else object.__delattr__)(owner, name)
    else:
        (setattr if plain else object.__setattr__)(owner, name, value)


def original(owner: Any, name: str) -> Any:
    """What ``owner.name`` is outside every span (the attribute itself when it is not patched)."""
    with _lock:
        slot = _held.get((id(owner), name))
    if slot is None:
        return getattr(owner, name)
    if slot[2] is not _MISSING:
        return slot[2]
    if isinstance(owner, type):  # inherited: the first base that defines it
        return next(vars(k)[name] for k in owner.__mro__[1:] if name in vars(k))
    attr = getattr(type(owner), name)  # an instance: its class's, bound to it
    return attr.__get__(owner, type(owner)) if hasattr(attr, "__get__") else attr


@contextlib.contextmanager
def patched(patches: Iterable[Patch]) -> Iterator[None]:
    """Set each ``owner.name`` to its replacement inside the block; restore what was there after it."""
    entered: list[tuple[int, str]] = []
    try:
        with _lock:
            for owner, name, replacement in patches:
                key = (id(owner), name)
                slot = _held.get(key)
                if slot is None:
                    _held[key] = [1, owner, vars(owner).get(name, _MISSING)]
                    _set(owner, name, replacement)
                else:
                    slot[0] += 1
                entered.append(key)
        yield
    finally:
        with _lock:
            for key in reversed(entered):
                slot = _held[key]
                slot[0] -= 1
                if slot[0] == 0:
                    del _held[key]
                    _set(slot[1], key[1], slot[2])
