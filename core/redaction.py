"""Credentials kept out of what wicore prints, logs and renders, and a Redis password moved in
and out of its URL. A Redis URL carries its password as userinfo (`redis://user:PW@host`,
`rediss://:PW@host`, `unix://:PW@/path`) or as a query parameter (`redis://host/0?password=PW`);
both are masked wherever they appear in a text."""

from __future__ import annotations

import re
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlencode, urlsplit

MASK = "***"
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/@\s:]*):[^/@\s]*@")
_QUERY = re.compile(r"(?i)([?&]password=)[^&#\s'\"]*")


def redact(text: str) -> str:
    """'redis://user:secret@host/0?password=x' -> 'redis://user:***@host/0?password=***', anywhere in `text`."""
    return _QUERY.sub(rf"\g<1>{MASK}", _USERINFO.sub(rf"\g<1>:{MASK}@", text))


def split_password(url: str) -> tuple[str, str | None]:
    """(the URL without its password, the password or None); a user name stays in the URL."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    from_query = [v for k, v in query if k.lower() == "password"]
    password = unquote(parts.password) if parts.password is not None else (from_query[-1] if from_query else None)
    user = f"{parts.username}@" if parts.username else ""
    netloc = user + parts.netloc.rpartition("@")[2]
    rest = urlencode([(k, v) for k, v in query if k.lower() != "password"])
    return _joined(parts._replace(netloc=netloc, query=rest)), password


def with_password(url: str, password: str) -> str:
    """`url` (which holds no password) with `password` as its userinfo."""
    parts = urlsplit(url)
    user = parts.username or ""
    netloc = f"{user}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return _joined(parts._replace(netloc=netloc))


def _joined(parts: SplitResult) -> str:
    """urlunsplit, keeping the `//` of an empty host (unix:///path)."""
    text = f"{parts.scheme}://{parts.netloc}{parts.path}"
    return text + (f"?{parts.query}" if parts.query else "") + (f"#{parts.fragment}" if parts.fragment else "")


def masked_url(url: str) -> str:
    """An image URL fit for an error line: its password and every query value masked
    ('https://u:pw@host/a.jpg?X-Amz-Signature=abc' -> 'https://u:***@host/a.jpg?X-Amz-Signature=***'):
    a presigned URL's query is its credential."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact(url)
    if not parts.scheme or not url[len(parts.scheme) :].startswith("://"):
        return url  # a path
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:{MASK}@{netloc.rpartition('@')[2]}"
    query = "&".join(f"{key}={MASK}" for key, _ in parse_qsl(parts.query, keep_blank_values=True))
    if parts.query and not query:
        query = MASK
    return _joined(parts._replace(netloc=netloc, query=query, fragment=""))
