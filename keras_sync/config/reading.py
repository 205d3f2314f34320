"""A config source read into plain data, within size limits, with the line of every key.

The YAML file is read here and nowhere else: safe YAML without tags or aliases, keeping node marks
for ``file:line``. The limits are far above a real config (a few kilobytes) and low enough that
reading never runs out of time, memory or recursion (the YAML composer recurses once per level);
they hold for every source: the file, a dict, overrides and environment variables.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from keras_sync.errors import ConfigError, ConfigIssue

MAX_FILE_BYTES = 1024 * 1024
MAX_DEPTH = 32
MAX_KEYS = 10_000
MAX_KEY_CHARS = 256
MAX_STRING_BYTES = 64 * 1024
_SHOWN_PATH_CHARS = 120  # a longer key path is shown by its two ends


def error(file: str, line: int | None, message: str, key_path: str = "") -> ConfigError:
    return ConfigError(ConfigIssue(file, line, key_path, message))


class _Sizes:
    """Counts the values of one source in order and refuses the first one over a limit."""

    def __init__(self, file: str):
        self.file, self.entries = file, 0

    def node(
        self, path: str, line: int | None, depth: int, entries: int, key: str | None, string: Any
    ) -> None:
        """One value: ``depth`` counts the collections around a collection, itself included (0 for a
        scalar); ``entries``: the keys and list items it adds; ``key``: its name if it is a key;
        ``string``: the value (only a string is measured)."""
        self.entries += entries
        if self.entries > MAX_KEYS:
            problem = f"more than {MAX_KEYS:,} keys and list items, the limit for a config; a keras-sync config has about 40: check that this is the file you meant"
        elif isinstance(key, str) and len(key) > MAX_KEY_CHARS:
            problem = f"a key of {len(key):,} characters, over the limit of {MAX_KEY_CHARS} for a key name; the config's keys are words such as run_name (keras-sync schema lists them)"
        elif depth > MAX_DEPTH:
            problem = f"nested more than {MAX_DEPTH} levels deep, the limit for a config; its sections nest 3 levels (keras-sync schema shows them)"
        # At most 4 UTF-8 bytes a character: only a string that could be over is encoded.
        elif (
            isinstance(string, str)
            and len(string) * 4 > MAX_STRING_BYTES
            and (size := len(string.encode("utf-8", "surrogatepass"))) > MAX_STRING_BYTES
        ):
            problem = f"a string of {size:,} bytes, over the limit of {MAX_STRING_BYTES:,} bytes (64 KiB) for a config value; names, paths and URIs are shorter: shorten it"
        else:
            return
        half = _SHOWN_PATH_CHARS // 2
        shown = path if len(path) <= _SHOWN_PATH_CHARS else f"{path[:half]}...{path[-half:]}"
        raise error(self.file, line, problem, shown)


def check_data(data: Any, file: str) -> None:
    """Refuse ``data`` (a dict of config values) over a limit, walking it without recursion."""
    sizes = _Sizes(file)
    stack: list[tuple[Any, str, int, int, str | None]] = [(data, "", 0, 0, None)]
    while stack:
        value, path, depth, entries, key = stack.pop()
        collection = isinstance(value, (Mapping, list, tuple))
        if collection and sizes.entries + entries + len(value) > MAX_KEYS:
            entries += len(value)  # refused here, not walked one by one
        sizes.node(path, None, depth + 1 if collection else 0, entries, key, value)
        if isinstance(value, Mapping):
            for k, v in reversed(list(value.items())):
                name = _key_name(k)
                stack.append((v, f"{path}.{name}" if path else name, depth + 1, 1, name))
        elif collection:
            items = reversed(list(enumerate(value)))
            stack.extend((v, f"{path}[{i}]", depth + 1, 1, None) for i, v in items)


def _key_name(key: Any) -> str:
    if isinstance(key, str):
        return key
    try:
        return repr(key)[: MAX_KEY_CHARS + 1]
    except ValueError:  # an int of more than 4,300 digits
        return f"<{type(key).__name__}>"


def read_text(path: Path) -> str:
    """The text of a config file; `ConfigError` when it is missing, too big or not UTF-8."""
    file = str(path)
    if not path.exists():
        msg = "no such file; create one with 'keras-sync init' or pass the right path"
        raise error(file, None, msg)
    if path.is_dir():
        raise error(
            file, None, f"is a directory, expected a YAML file (e.g. {path / 'keras_sync.yaml'})"
        )
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            raw = f.read(MAX_FILE_BYTES + 1)  # a pipe or a /proc file says size 0
    except OSError as exc:
        raise error(file, None, f"cannot read the file: {exc.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        said = f"is {size:,} bytes," if size > MAX_FILE_BYTES else "is"
        msg = f"the file {said} over the limit of {MAX_FILE_BYTES:,} bytes (1 MiB) for a config file; a keras-sync config is a few kilobytes: check that this is the file you meant"
        raise error(file, None, msg)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        msg = f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save the file as UTF-8 YAML"
        raise error(file, raw[: exc.start].count(b"\n") + 1, msg) from None


def parse_yaml(text: str, file: str) -> tuple[Any, dict[str, int]]:
    """The data of a YAML text, and the 1-based line of every key path (``""``: the top)."""
    import yaml

    sizes = _Sizes(file)
    paths: list[str] = []  # the key paths of the nodes being composed: the next one's ancestors

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            # Checked before a node is composed: the composer recurses once per level.
            event = self.peek_event()
            line = event.start_mark.line + 1
            if isinstance(event, yaml.AliasEvent):  # nested aliases expand exponentially
                a = event.anchor
                msg = f"YAML alias *{a} not allowed; keras-sync reads plain YAML only: write the value out instead of *{a} (and drop the anchor &{a})"
                raise error(file, line, msg)
            path, key = paths[-1] if paths else "", None
            scalar = isinstance(event, yaml.ScalarEvent)
            if isinstance(parent, yaml.MappingNode):
                if index is None:  # this node is a key
                    name = key = event.value if scalar else "?"
                else:
                    name = index.value if isinstance(index, yaml.ScalarNode) else "?"
                path = f"{path}.{name}" if path else name
            elif isinstance(parent, yaml.SequenceNode):
                path = f"{path}[{index}]"
            depth = 0 if scalar else len(paths) + 1
            entries = int(key is not None or isinstance(parent, yaml.SequenceNode))
            sizes.node(
                path, line, depth, entries, key, event.value if scalar and key is None else None
            )
            paths.append(path)
            try:
                return super().compose_node(parent, index)
            finally:
                paths.pop()

    lines: dict[str, int] = {}
    dups: list[ConfigIssue] = []
    loader = Loader(text)

    def data(node: Any, path: str) -> Any:
        if node.tag == yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG:
            lines.setdefault(path, node.start_mark.line + 1)
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = data(key_node, path)
                key = str(key) if isinstance(key, (list, dict)) else key
                key_path, line = f"{path}.{key}" if path else str(key), key_node.start_mark.line + 1
                if key in out:
                    msg = (
                        f"duplicate key {key!r} (first at line {lines[key_path]}); keep one of them"
                    )
                    dups.append(ConfigIssue(file, line, key_path, msg))
                lines.setdefault(key_path, line)
                out[key] = data(value_node, key_path)
            return out
        if node.tag == yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG:
            return [data(v, f"{path}[{i}]") for i, v in enumerate(node.value)]
        try:
            return loader.construct_object(node, deep=True)
        except ValueError as exc:  # more digits than Python converts, a date that is none
            msg = f"cannot read {node.value!r} ({exc}); quote it to keep it as text"
            if node.tag == "tag:yaml.org,2002:int":
                msg = f"a number of {len(node.value):,} digits, more than Python reads; the config's numbers are small: shorten it"
            raise error(file, node.start_mark.line + 1, msg) from None

    try:
        root = loader.get_single_node()
        value = None if root is None else data(root, "")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        if isinstance(exc, yaml.constructor.ConstructorError):
            msg = f"YAML tag not allowed ({exc.problem}); keras-sync reads plain YAML only: remove the '!!' tag"
            raise error(file, line, msg) from None
        msg = f"YAML syntax error: {getattr(exc, 'problem', None) or exc}"
        raise error(file, line, msg) from None
    finally:
        loader.dispose()
    if dups:
        raise ConfigError(dups)
    return value, lines
