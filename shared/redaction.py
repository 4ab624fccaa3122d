"""One redaction for every text that leaves a process: log lines, metric labels, HTTP errors, dead letters and
run files.

Secrets travel inside texts nobody wrote to hold them: an exception quotes the URL it failed on
(``http://user:pass@host/score``), a breaker keeps that exception as its last error and says it in a warning,
in ``/ready`` and in the scorer's "paused" line; a header dict shows up in a repr. :func:`redact` masks what a
secret looks like wherever it stands in a text (URL credentials, ``Authorization``-like headers, bearer tokens,
secret query parameters); it is idempotent and changes nothing else, so it is applied where such a text is
made (:class:`shared.resilience.CircuitBreaker`, :func:`shared.intake.reject`) rather than at each reader.
"""

from __future__ import annotations

import re

MASK = "***"
# scheme://user:password@ or scheme://token@ (a username alone is often a token: https://<token>@host).
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^\s/?#@'\"<>]+)@")
# A header or setting that holds a secret, as ``name: value``, ``name=value`` or ``'name': 'value'`` (a quoted
# value is masked to its closing quote, spaces and all).
_SECRET_FIELD = re.compile(
    r"(?i)(?P<name>\b(?:authorization|proxy-authorization|x-api-key|api[-_]?key|api[-_]?token|access[-_]?token|"
    r"token|password|passwd|secret|cookie|set-cookie)['\"]?\s*[:=]\s*)"
    r"(?:(?P<quote>['\"])(?:(?P<qscheme>bearer|basic|token)\s+)?(?P<quoted>[^'\"]*)(?P=quote)"
    r"|(?:(?P<scheme>bearer|basic|token)\s+)?(?P<value>[^\s'\",;}&]+))"
)
_BEARER = re.compile(r"(?i)\b(?P<scheme>bearer|basic)\s+(?P<value>[A-Za-z0-9._~+/=-]{8,})")


def _userinfo(match: re.Match[str]) -> str:
    user, colon, _ = match["userinfo"].partition(":")
    shown = f"{user}:{MASK}" if colon else MASK
    return f"{match['scheme']}{shown}@"


def _field(match: re.Match[str]) -> str:
    scheme = match["qscheme"] or match["scheme"]
    shown = f"{scheme} {MASK}" if scheme else MASK
    quote = match["quote"] or ""
    return f"{match['name']}{quote}{shown}{quote}"


def redact(text: str) -> str:
    """``text`` with every secret it seems to hold masked as ``***``: URL credentials (the user of a URL with a
    password is kept), header or setting values named like secrets, bearer and basic credentials."""
    text = _URL_USERINFO.sub(_userinfo, text)
    text = _SECRET_FIELD.sub(_field, text)
    return _BEARER.sub(lambda m: f"{m['scheme']} {MASK}", text)


def redacted_error(exc: BaseException) -> str:
    """``"<ErrorType>: <message>"`` of ``exc``, redacted: what a log line, a dead letter or an HTTP error says."""
    return redact(f"{type(exc).__name__}: {exc}")
