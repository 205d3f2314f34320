"""Keep secrets out of everything keras-sync logs: URI credentials and secret-looking env values.

The texts are the user's, of any length, so each scan finds a fixed anchor first (``://``, a
query separator) and looks around it: the regexes that define the matches would be quadratic.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterator, Mapping

_REDACTED = "***"

_LETTERS = frozenset(string.ascii_letters)
_SCHEME_CHARS = _LETTERS | frozenset(string.digits + "+.-")
#: ``://`` and what may follow it up to the ``@`` of credentials (RFC 3986 userinfo, loosely).
_USERINFO = re.compile(r"://[^/?#@\s]*@")
_QUERY_SEPARATOR = re.compile(r"[?&;]")
_QUERY_KEY_END = re.compile(r"[=&#\s]")
_QUERY_VALUE_END = re.compile(r"[&#;\s]")
_SECRET_WORD = re.compile(
    r"token|password|passwd|secret|key|sig|signature|credential|auth", re.IGNORECASE
)
_SECRET_ENV_NAME = re.compile(
    r"TOKEN|PASSWORD|PASSWD|SECRET|API_?KEY|PRIVATE_KEY|CREDENTIAL", re.IGNORECASE
)
_NOT_SECRET_VALUES = {"", "0", "1", "true", "false", "none", "null", "yes", "no"}


def _userinfo_spans(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each ``user:password@`` of ``([A-Za-z][A-Za-z0-9+.-]*://)[^/?#@\\s]*@``."""
    for m in _USERINFO.finditer(text):
        start = m.start()
        while start > 0 and text[start - 1] in _SCHEME_CHARS:
            start -= 1  # not past an earlier match: it ends with "@"
        if not _LETTERS.isdisjoint(text[start : m.start()]):  # a scheme begins with a letter
            yield m.start() + 3, m.end()


def _secret_query_spans(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each value of ``[?&;][^=&#\\s]*(token|password|...)[^=&#\\s]*=([^&#;\\s]*)``."""
    pos = 0
    while True:
        sep = _QUERY_SEPARATOR.search(text, pos)
        if sep is None:
            return
        key_start = sep.end()
        end = _QUERY_KEY_END.search(text, key_start)
        if end is None:
            return
        key_end = end.start()
        if text[key_end] != "=" or _SECRET_WORD.search(text, key_start, key_end) is None:
            pos = key_end if text[key_end] != "=" else key_end + 1
            continue
        value_end = _QUERY_VALUE_END.search(text, key_end + 1)
        stop = value_end.start() if value_end else len(text)
        yield key_end + 1, stop
        pos = stop


def _replace_spans(text: str, spans: Iterator[tuple[int, int]], by: str) -> str:
    out, kept = [], 0
    for start, end in spans:
        out += [text[kept:start], by]
        kept = end
    return "".join([*out, text[kept:]])


def redact_uri(uri: str | None) -> str | None:
    """Return ``uri`` without ``user:password@`` and with secret query values replaced by ``***``.

    >>> redact_uri("http://user:s3cret@127.0.0.1:5000/?token=abc&x=1")
    'http://127.0.0.1:5000/?token=***&x=1'
    """
    if uri is None:
        return None
    uri = _replace_spans(uri, _userinfo_spans(uri), "")
    return _replace_spans(uri, _secret_query_spans(uri), _REDACTED)


def secrets_of(tracking_uri: str | None, environ: Mapping[str, str]) -> list[str]:
    """Credentials in ``tracking_uri`` and secret-named env values (3+ chars), longest first."""
    found: set[str] = set()
    for name, value in environ.items():
        if _SECRET_ENV_NAME.search(name) and value.strip().lower() not in _NOT_SECRET_VALUES:
            found.add(value)
    if tracking_uri:
        m = re.match(r"[A-Za-z][A-Za-z0-9+.\-]*://([^/?#@\s]*)@", tracking_uri)
        if m:
            found.update(p for p in m.group(1).split(":")[1:] if p)
        found.update(tracking_uri[start:end] for start, end in _secret_query_spans(tracking_uri))
    return sorted((s for s in found if len(s) >= 3), key=len, reverse=True)


def redact_text(text: str, secrets: list[str]) -> str:
    """``text`` with URI credentials and every string of ``secrets`` replaced by ``***``."""
    text = redact_uri(text) or ""
    for s in secrets:
        text = text.replace(s, _REDACTED)
    return text
