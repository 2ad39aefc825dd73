"""Images as HTTP clients send them: base64 or a data URI (the bytes travel to Redis as a blob),
an absolute path under the allowed roots (workers read the file; the gateway reads it once to
hash it, so it must see the same files), or an http(s):// or s3:// URL, which the gateway only
checks the form of: a worker fetches it, under its URL policy."""

from __future__ import annotations

import base64
import binascii
import re
import stat
from pathlib import Path

from wicore.gateway.errors import ApiError
from wicore.redaction import masked_url
from wicore.schemas import image_url

DATA_URI = re.compile(r"^data:(?:[\w.+-]+/[\w.+-]+)?(?:;[\w.+-]+=[\w.+-]+)*;base64,", re.IGNORECASE)
FILE_URL = "file://"


def decode_image(text: str, field: str) -> bytes:
    """'data:image/png;base64,...' or bare base64 -> the image's bytes."""
    body = text
    if text[:5].lower() == "data:":
        match = DATA_URI.match(text)
        if match is None:
            raise ApiError(400, f"{field}: a data URI must read data:image/<type>;base64,<data>", param=field)
        body = text[match.end() :]
    try:
        data = base64.b64decode("".join(body.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(
            400, f"{field}: not valid base64 (send the image's bytes base64-encoded, or a data URI)", param=field
        ) from None
    if not data:
        raise ApiError(400, f"{field}: the image is empty", param=field)
    return data


def allowed_path(raw: str, roots: tuple[Path, ...], field: str) -> Path:
    """An absolute path (or file:// URL) that resolves under one of `roots`."""
    if not roots:
        raise ApiError(
            400,
            f"{field}: image paths are not accepted by this gateway (it has no --allow-root); "
            "send the image's bytes instead",
            param=field,
        )
    text = raw[len(FILE_URL) :] if raw.startswith(FILE_URL) else raw
    try:
        path = Path(text)
        resolved = path.resolve() if path.is_absolute() else None
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        raise ApiError(400, f"{field}: {raw!r} cannot be resolved ({exc})", param=field) from None
    if resolved is None:
        raise ApiError(400, f"{field}: {raw!r} is not a valid absolute path", param=field)
    if not any(resolved.is_relative_to(root) for root in roots):
        listed = ", ".join(str(r) for r in roots)
        raise ApiError(400, f"{field}: {raw} is outside the allowed roots ({listed})", param=field)
    if not regular_or_missing(resolved):  # a FIFO would block its reader; a folder or device is no image
        raise ApiError(400, f"{field}: {raw} is not a regular file", param=field)
    return resolved


def regular_or_missing(path: Path) -> bool:
    """False for a FIFO, socket, device or folder (a missing file is reported when it is read)."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return True


def fetched_url(url: str, field: str) -> str:
    """An http(s):// or s3:// URL a worker will fetch, its form checked here."""
    try:
        return image_url(url)
    except ValueError as exc:
        raise ApiError(400, f"{field}: {masked_url(url)}: {exc}", param=field) from None


def image_from_url(url: str, roots: tuple[Path, ...], field: str) -> bytes | Path | str:
    """An OpenAI `image_url.url`: a data URI, a path / file:// URL under the allowed roots, or an
    http(s):// / s3:// URL (returned as given: a worker fetches it)."""
    if url[:5].lower() == "data:":
        return decode_image(url, field)
    if url.startswith(("/", FILE_URL)):
        return allowed_path(url, roots, field)
    if "://" in url[:10]:
        return fetched_url(url, field)
    raise ApiError(
        400,
        f"{field}: send a data URI (data:image/png;base64,...), an http(s):// or s3:// URL, "
        "or a path under the allowed roots",
        param=field,
    )
