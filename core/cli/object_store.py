"""Files by URL for the dataset inputs: local paths through the standard library, s3:// through
s3fs (the `datasets` extra). S3 credentials come from the standard AWS chain (environment,
~/.aws, instance or pod roles); the endpoint of an S3-compatible store from --s3-endpoint-url,
WICORE_S3_ENDPOINT_URL, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, in that order."""

from __future__ import annotations

import glob as local_glob
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

from wicore.errors import ConfigError

S3 = "s3://"
GLOB_CHARS = "*?["


def is_s3(url: str) -> bool:
    return url.startswith(S3)


def has_glob(url: str) -> bool:
    return any(char in url for char in GLOB_CHARS)


@lru_cache(maxsize=4)
def s3_filesystem(endpoint: str | None):
    from wicore.cli.failures import require

    require("s3fs")
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint) if endpoint else s3fs.S3FileSystem()


class Store:
    """Where the dataset inputs lie: the local disk, or S3 at one endpoint."""

    def __init__(self, endpoint: str | None = None):
        self.endpoint = endpoint

    def open(self, url: str) -> BinaryIO:
        return self._s3().open(url, "rb") if is_s3(url) else open(url, "rb")  # noqa: SIM115 (the caller closes it)

    def size(self, url: str) -> int:
        return int(self._s3().size(url)) if is_s3(url) else Path(url).stat().st_size

    def read(self, url: str, limit: int) -> bytes:
        """The file's bytes; OSError when it is missing or unreadable, ValueError over `limit`."""
        size = self.size(url)
        if size > limit:
            raise ValueError(f"{size} bytes is over the {limit}-byte limit (max_image_bytes)")
        with self.open(url) as source:
            return source.read()

    def glob(self, pattern: str) -> list[str]:
        if is_s3(pattern):
            return sorted(S3 + path for path in self._checked(self._s3().glob, pattern))
        return sorted(local_glob.glob(pattern, recursive=True))

    def is_dir(self, url: str) -> bool:
        return self._checked(self._s3().isdir, url) if is_s3(url) else Path(url).is_dir()

    def exists(self, url: str) -> bool:
        return self._checked(self._s3().exists, url) if is_s3(url) else Path(url).exists()

    def find(self, prefix: str) -> dict[str, int]:
        """{url: size} of every object under an s3:// prefix, in key order."""
        found = self._checked(self._s3().find, prefix.rstrip("/") + "/", detail=True)
        return {S3 + path: int(info.get("size") or 0) for path, info in sorted(found.items())}

    def _s3(self):
        return s3_filesystem(self.endpoint)

    def _checked(self, call, url: str, **kwargs):
        """An S3 listing call; a refusal (no credentials, access denied, no endpoint) as one line."""
        try:
            return call(url, **kwargs)
        except store_errors() as exc:
            raise ConfigError(
                f"{url}: cannot list ({type(exc).__name__}: {exc}); check the AWS credentials and --s3-endpoint-url"
            ) from exc


def store_errors() -> tuple[type[Exception], ...]:
    """What reading a file or an object may raise: OSError (s3fs turns S3's refusals into its
    kinds) and botocore's own errors (no credentials, an endpoint that does not answer)."""
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:
        return (OSError,)
    return (OSError, BotoCoreError)
