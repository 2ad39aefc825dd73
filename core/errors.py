"""Every error wicore raises on purpose, in one flat module (as rq's exceptions.py).

`JobInputError` and its children are the job's own fault: they fail that job alone, at once, with
no retry. Anything else raised while a batch runs is treated as transient and retried.
"""

from __future__ import annotations


class WicoreError(Exception):
    """Base of wicore's own errors."""


class ConfigError(WicoreError):
    """A setting is missing, unknown or out of range."""


class JobInputError(WicoreError):
    """The job itself is bad; running it again cannot help."""


class ImageError(JobInputError):
    """The image cannot be read, is not an image, or is over a limit."""


class ImageTooLarge(ImageError):
    """Over the byte or pixel limit (decompression bombs land here)."""


class ImageNotAllowed(ImageError):
    """A path outside every allowed root, or a blob that is missing from Redis."""


class PromptTooLong(JobInputError):
    """The prompt plus image tokens plus max_new_tokens exceed what the engine can hold."""


class DeadlineExceeded(JobInputError):
    """The job's deadline passed before a worker could start it; it was not run."""


class JobFailed(WicoreError):
    """Raised to a producer waiting on a job that ended in failure."""

    def __init__(self, job_id: str, message: str):
        super().__init__(f"job {job_id} failed: {message}")
        self.job_id = job_id
        self.message = message


class JobCanceled(JobFailed):
    """Raised to a producer waiting on a job that was canceled before it ended."""


class UnknownJob(WicoreError):
    """No such job in Redis (never submitted, or its result expired)."""


class ResultTimeout(WicoreError):
    """The job did not finish within the time the caller was willing to wait."""


class EngineError(WicoreError):
    """The engine failed for a reason that is not the input's fault (OOM, device lost)."""


class ShutdownRequested(BaseException):
    """Derives from BaseException so that `except Exception` cannot swallow a stop request."""
