"""A config source read into plain data with the line of every key, within size limits far above a
real config. The YAML file is read here and nowhere else (safe YAML, no tags or aliases)."""

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
_DEPTH_PROBLEM = f"nested more than {MAX_DEPTH} levels deep, the limit for a config; its sections nest 3 levels (keras-sync schema shows them)"


def error(file: str, line: int | None, message: str, key_path: str = "") -> ConfigError:
    shown = key_path if len(key_path) <= 120 else f"{key_path[:60]}...{key_path[-60:]}"
    return ConfigError(ConfigIssue(file, line, shown, message))


def check_data(data: Any, file: str, lines: Mapping[str, int] | None = None) -> None:
    """Refuse the first value of ``data`` over a limit, in document order."""
    entries = -1  # the top is no entry

    def check(path: str, value: Any, key: str | None, depth: int) -> None:
        nonlocal entries
        entries += 1
        nested = isinstance(value, (Mapping, list, tuple))
        size = len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else 0
        if entries > MAX_KEYS:
            problem = f"more than {MAX_KEYS:,} keys and list items, the limit for a config; a keras-sync config has about 40: check that this is the file you meant"
        elif key is not None and len(key) > MAX_KEY_CHARS:
            problem = f"a key of {len(key):,} characters, over the limit of {MAX_KEY_CHARS} for a key name; the config's keys are words such as run_name (keras-sync schema lists them)"
        elif nested and depth > MAX_DEPTH:  # checked before recursing: at most MAX_DEPTH levels
            problem = _DEPTH_PROBLEM
        elif size > MAX_STRING_BYTES:
            problem = f"a string of {size:,} bytes, over the limit of {MAX_STRING_BYTES:,} bytes (64 KiB) for a config value; names, paths and URIs are shorter: shorten it"
        elif isinstance(value, Mapping):
            for k, v in value.items():
                name = k if isinstance(k, str) else repr(k)[: MAX_KEY_CHARS + 1]
                check(f"{path}.{name}" if path else name, v, name, depth + 1)
            return
        else:
            for i, v in enumerate(value if nested else ()):
                check(f"{path}[{i}]", v, None, depth + 1)
            return
        raise error(file, (lines or {}).get(path), problem, path)

    check("", data, None, 1)


def read_text(path: Path) -> str:
    """The text of a config file; `ConfigError` when it is missing, too big or not UTF-8."""
    file = str(path)
    if not path.exists():
        msg = "no such file; create one with 'keras-sync init' or pass the right path"
        raise error(file, None, msg)
    if path.is_dir():
        msg = f"is a directory, expected a YAML file (e.g. {path / 'keras_sync.yaml'})"
        raise error(file, None, msg)
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


def parse_yaml(text: str, file: str) -> tuple[dict[str, Any], dict[str, int]]:
    """The mapping of a YAML text, and the 1-based line of every key path and list item (``""``: the top)."""
    import yaml

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
            path = paths[-1] if paths else ""
            if isinstance(parent, yaml.SequenceNode):
                path = f"{path}[{index}]"
            elif parent is not None:  # a value (a key nests only when complex: "?")
                name = index.value if isinstance(index, yaml.ScalarNode) else "?"
                path = f"{path}.{name}" if path else name
            if not isinstance(event, yaml.ScalarEvent) and len(paths) >= MAX_DEPTH:
                raise error(file, line, _DEPTH_PROBLEM, path)
            paths.append(path)
            try:
                return super().compose_node(parent, index)
            finally:
                paths.pop()

    lines: dict[str, int] = {}
    dups: list[ConfigIssue] = []
    loader = Loader(text)

    def data(node: Any, path: str) -> Any:
        lines.setdefault(path, node.start_mark.line + 1)
        if node.tag == yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG:
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = data(key_node, path)
                key = str(key) if isinstance(key, (list, dict)) else key
                key_path, line = f"{path}.{key}" if path else str(key), key_node.start_mark.line + 1
                if key in out:
                    msg = f"duplicate key {key!r} (first at line {lines[key_path]}); keep one of them, delete the other"
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
    if value is None:
        msg = "the file is empty; write at least one key, e.g. 'strategy: {kind: mirrored}', or delete the file to use the defaults"
        raise error(file, 1, msg)
    if not isinstance(value, dict):
        msg = f"received a {type(value).__name__} at the top level, expected a mapping with keys such as strategy, batch, learning_rate"
        raise error(file, lines.get("", 1), msg)
    check_data(value, file, lines)
    return value, lines
