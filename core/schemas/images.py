"""An image as a job refers to it: a file path, a blob by its sha256, or a URL."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, model_validator

from wicore.schemas.base import Strict, unicode_text

SHA256_HEX = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def file_path(value: str) -> str:
    if "\x00" in value:
        raise ValueError("a path cannot hold a NUL byte")
    return unicode_text(value)


FilePath = Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(file_path)]
URL_SCHEMES = ("http", "https", "s3")


def image_url(value: str) -> str:
    """http(s)://host/... or s3://bucket/key; what may be fetched is the worker's policy."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError as exc:
        raise ValueError(f"not a valid URL ({exc})") from None
    if parts.scheme.lower() not in URL_SCHEMES:
        raise ValueError(f"URL scheme {parts.scheme!r} is not fetched: use http://, https:// or s3://")
    if not parts.hostname:
        raise ValueError("the URL names no host (or bucket)")
    if parts.scheme.lower() == "s3" and not parts.path.strip("/"):
        raise ValueError("an s3:// URL needs a key: s3://bucket/key")
    return unicode_text(value)


ImageUrl = Annotated[str, Field(min_length=1, max_length=8192), AfterValidator(image_url)]


class ImageRef(Strict):
    """An image by reference: a path under the worker's allowed roots, a blob the producer
    stored in Redis under its sha256, or a URL the worker fetches. The hash is always the hash
    of the image's bytes; a URL's is known only once the worker has fetched it (None here)."""

    sha256: SHA256_HEX | None = None
    path: FilePath | None = None
    url: ImageUrl | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ImageRef:
        if self.url is not None and (self.path is not None or self.sha256 is not None):
            raise ValueError("an image by url carries neither a path nor a sha256")
        if self.url is None and self.sha256 is None:
            raise ValueError("an image needs its sha256 (or a url)")
        return self

    @property
    def is_blob(self) -> bool:
        return self.path is None and self.url is None

    @property
    def identity(self) -> str:
        """What the job id hashes: the bytes' sha256, or the URL as given (the producer fetches
        nothing; the worker's caches key a URL's image by its fetched bytes' sha256)."""
        return self.sha256 if self.sha256 is not None else f"url:{self.url}"
