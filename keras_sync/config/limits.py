"""The sizes a config may have, checked before any work is done with it.

A config is a few kilobytes; these limits are far above that, and low enough that reading one
never runs out of time, memory or recursion (the YAML composer recurses once per level), and
no value is too long to pass to a child process. They apply to every source of values: the
file (with ``file:line`` and the key path), a dict, overrides and environment variables.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keras_sync.errors import ConfigError, ConfigIssue

MAX_FILE_BYTES = 1024 * 1024
MAX_DEPTH = 32
MAX_KEYS = 10_000
MAX_KEY_CHARS = 256
MAX_STRING_BYTES = 64 * 1024

_SHOWN_PATH_CHARS = 120  # a key path longer than this is shown by its two ends


def file_size_issue(file: str, size: int) -> ConfigIssue | None:
    """The issue of a config file of ``size`` bytes; None within the limit."""
    if size <= MAX_FILE_BYTES:
        return None
    return ConfigIssue(
        file,
        None,
        "",
        f"the file is {size:,} bytes, over the limit of {MAX_FILE_BYTES:,} bytes "
        "(1 MiB) for a config file; a keras-sync config is a few kilobytes: check that this is "
        "the file you meant",
    )


class SizeCounter:
    """Counts the values of one source and refuses the first one over a limit.

    `node` is called for every value before it is built, by the YAML composer and `check_data`:
    ``depth`` counts the collections around it (and itself if it is one); ``entry``: a mapping
    key or list item; ``key``: a mapping key of this name; ``string``: this string value.
    """

    def __init__(self, file: str):
        self.file = file
        self.keys = 0

    def node(
        self,
        path: str,
        depth: int,
        line: int | None,
        *,
        entry: bool = False,
        collection: bool = False,
        key: str | None = None,
        string: str | None = None,
    ) -> None:
        if entry:
            self.keys += 1
            if self.keys > MAX_KEYS:
                self._refuse(
                    path,
                    line,
                    f"more than {MAX_KEYS:,} keys and list items, the limit for a config; "
                    "a keras-sync config has about 40: check that this is the file you meant",
                )
        if key is not None and len(key) > MAX_KEY_CHARS:
            self._refuse(
                path,
                line,
                f"a key of {len(key):,} characters, over the limit of {MAX_KEY_CHARS} for a key "
                "name; the config's keys are words such as run_name (keras-sync schema lists them)",
            )
        if collection and depth > MAX_DEPTH:
            self._refuse(
                path,
                line,
                f"nested more than {MAX_DEPTH} levels deep, the limit for a config; its "
                "sections nest 3 levels (keras-sync schema shows them)",
            )
        # At most 4 UTF-8 bytes a character: encode only a string that could be over.
        if string is not None and len(string) * 4 > MAX_STRING_BYTES:
            size = len(string.encode("utf-8", "surrogatepass"))
            if size > MAX_STRING_BYTES:
                self._refuse(
                    path,
                    line,
                    f"a string of {size:,} bytes, over the limit of {MAX_STRING_BYTES:,} bytes "
                    "(64 KiB) for a config value; names, paths and URIs are shorter: shorten it",
                )

    def _refuse(self, path: str, line: int | None, message: str) -> None:
        # A long key path is shown by its two ends.
        half = _SHOWN_PATH_CHARS // 2
        shown = path if len(path) <= _SHOWN_PATH_CHARS else f"{path[:half]}...{path[-half:]}"
        raise ConfigError(ConfigIssue(self.file, line, shown, message))


def check_data(data: Any, file: str) -> None:
    """Refuse ``data`` (a dict of config values) with a `ConfigError` if it passes a limit
    (a walk without recursion)."""
    counter = SizeCounter(file)
    stack: list[tuple[Any, str, int, bool, str | None]] = [(data, "", 0, False, None)]
    while stack:
        value, path, depth, entry, key = stack.pop()
        if key is not None:  # the key itself, then its value
            counter.node(path, depth, None, entry=True, key=key)
            entry = False
        is_collection = isinstance(value, (Mapping, list, tuple))
        counter.node(
            path,
            depth + is_collection,
            None,
            entry=entry,
            collection=is_collection,
            string=value if isinstance(value, str) else None,
        )
        if is_collection and counter.keys + len(value) > MAX_KEYS:
            counter.keys += len(value)
            counter.node(path, depth, None, entry=True)  # refuses: no need to walk them one by one
        if isinstance(value, Mapping):
            for k, v in reversed(list(value.items())):
                name = _key_name(k)
                stack.append((v, f"{path}.{name}" if path else name, depth + 1, False, name))
        elif isinstance(value, (list, tuple)):
            for i in reversed(range(len(value))):
                stack.append((value[i], f"{path}[{i}]", depth + 1, True, None))


def _key_name(key: Any) -> str:
    if isinstance(key, str):
        return key
    try:
        return repr(key)[: MAX_KEY_CHARS + 1]
    except ValueError:  # an int of more than 4,300 digits
        return f"<{type(key).__name__}>"
