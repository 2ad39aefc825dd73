"""Every error wicore raises on purpose, in one flat module (as rq's exceptions.py).

`JobInputError` and its children are the job's own fault: they fail that job alone, at once, with
no retry. Anything else raised while a batch runs is treated as transient and retried.
"""

from __future__ import annotations


class WicoreError(Exception):
    """Base of wicore's own errors."""


class ConfigError(WicoreError):
    """A setting is missing, unknown or out of range."""

    @classmethod
    def from_validation(cls, exc, model, what: str = "setting") -> ConfigError:
        """One line from a pydantic ValidationError of `model`: each bad key by its dotted name
        (`engine.block_size`), what is wrong with it and the value given (never a URL's: it may
        carry a password), and the keys known where one is unknown."""
        return cls("bad configuration: " + "; ".join(_describe(error, model, what) for error in exc.errors()))


SECRET_KEYS = ("url", "dashboard_auth")  # settings whose values may hold a password: never echoed


def _describe(error: dict, model, what: str) -> str:
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc) or "(settings)"
    if error["type"] == "extra_forbidden":
        known = ", ".join(sorted(_model_at(model, loc[:-1]).model_fields))
        return f"unknown {what} {key!r} (known: {known})"
    message = error["msg"].removeprefix("Value error, ")
    given = error.get("input")
    if isinstance(given, int | float | str) and not key.endswith(SECRET_KEYS) and "got" not in message:
        message += f" (got {given!r})"
    return f"{what} {key}: {message}"


def _model_at(model, path: list[str]):
    """The nested model class that `path` (field names) leads to."""
    for name in path:
        model = model.model_fields[name].annotation
    return model


class RedisUnavailable(WicoreError):
    """Redis cannot be reached, refuses the credentials, or refuses writes."""


class FileStoreUnavailable(WicoreError):
    """The gateway's file store (an S3 bucket) cannot be reached or refuses a call."""


class JobInputError(WicoreError):
    """The job itself is bad; running it again cannot help."""


class InvalidJob(JobInputError):
    """The job's record in Redis is not a wicore caption job (unparsable, or not ours)."""


class ImageError(JobInputError):
    """The image cannot be read, is not an image, or is over a limit."""


class ImageTooLarge(ImageError):
    """Over the byte or pixel limit (decompression bombs land here)."""


class ImageFetchError(ImageError):
    """An image URL could not be fetched: refused by the URL policy, an HTTP error, a timeout."""


class ImageNotAllowed(ImageError):
    """A path outside every allowed root, or a blob that is missing from Redis."""


class TooManyImages(JobInputError):
    """More images in one request than the setting max_images_per_request allows."""


class OverLimit(JobInputError):
    """A request field over the deployment's cap (max_n, max_logprobs); `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class BadGrammar(JobInputError):
    """A `guided` spec that cannot be a grammar (a malformed JSON schema, a regex that does not
    compile), or one this worker cannot enforce (no `guided` extra installed)."""


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


class QueueFull(WicoreError):
    """Admission control refused the submission: its model's lane holds its cap of queued jobs.
    `retry_after_s`: the wait, estimated from the rate its jobs finished at lately."""

    def __init__(self, model: str, lane: str, queued: int, cap: int, retry_after_s: int):
        super().__init__(
            f"model {model}'s {lane} lane has {queued} queued jobs, at its cap of {cap}; "
            f"retry in about {retry_after_s}s"
        )
        self.model, self.lane, self.queued, self.cap, self.retry_after_s = model, lane, queued, cap, retry_after_s


class EngineError(WicoreError):
    """The engine failed for a reason that is not the input's fault (OOM, device lost)."""


class ShutdownRequested(BaseException):
    """Derives from BaseException so that `except Exception` cannot swallow a stop request."""
