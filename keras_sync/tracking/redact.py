"""Keep secrets out of everything keras-sync logs: URI credentials and secret-looking env values.

Used for every param, tag, artifact and log line the MLflow writer produces, and wherever a
tracking URI is shown (`keras-sync plan`, `env`, `ui`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_REDACTED = "***"

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#@\s]*@")
_SECRET_QUERY = re.compile(
    r"(?P<key>[?&;][^=&#\s]*(?:token|password|passwd|secret|key|sig|signature|credential|auth)"
    r"[^=&#\s]*=)[^&#;\s]*", re.IGNORECASE)
_SECRET_ENV_NAME = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|API_?KEY|PRIVATE_KEY|CREDENTIAL",
                              re.IGNORECASE)
_NOT_SECRET_VALUES = {"", "0", "1", "true", "false", "none", "null", "yes", "no"}


def redact_uri(uri: str | None) -> str | None:
    """Return ``uri`` without ``user:password@`` and with secret query values replaced by ``***``.

    >>> redact_uri("http://user:s3cret@127.0.0.1:5000/?token=abc&x=1")
    'http://127.0.0.1:5000/?token=***&x=1'
    """
    if uri is None:
        return None
    uri = _USERINFO.sub(lambda m: m.group("scheme"), uri)
    return _SECRET_QUERY.sub(lambda m: m.group("key") + _REDACTED, uri)


def secrets_of(tracking_uri: str | None, environ: Mapping[str, str]) -> list[str]:
    """The secret strings to scrub: credentials in ``tracking_uri`` and values of env vars named like
    TOKEN/PASSWORD/SECRET/API_KEY (3 characters or more), longest first."""
    found: set[str] = set()
    for name, value in environ.items():
        if _SECRET_ENV_NAME.search(name) and value.strip().lower() not in _NOT_SECRET_VALUES:
            found.add(value)
    if tracking_uri:
        m = re.match(r"[A-Za-z][A-Za-z0-9+.\-]*://([^/?#@\s]*)@", tracking_uri)
        if m:
            found.update(p for p in m.group(1).split(":")[1:] if p)
        for q in _SECRET_QUERY.finditer(tracking_uri):
            found.add(tracking_uri[q.end("key"):q.end()])
    found = {s for s in found if len(s) >= 3}
    return sorted(found, key=len, reverse=True)  # longest first: one secret may contain another


def redact_text(text: str, secrets: list[str]) -> str:
    """``text`` with URI credentials and every string of ``secrets`` replaced by ``***``."""
    text = redact_uri(text) or ""
    for s in secrets:
        text = text.replace(s, _REDACTED)
    return text
