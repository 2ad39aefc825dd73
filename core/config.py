"""Settings shared by every verb, one typed tree. Each key comes from the first of: flags >
environment (`WICORE_*`) > config file (TOML) > defaults, key by key, nested keys too (an engine
option from the file survives a flag that sets another one). Unknown keys fail loudly, in the
file and in the environment alike, nested ones too.

The `engine` section is the engine's name and the fast engine's options (FastOptions documents
each). Flags: `--engine NAME`, `--engine-option KEY=VALUE`. Environment: `WICORE_ENGINE=NAME`
and `WICORE_ENGINE__KEY=VALUE` (pydantic-settings' nested delimiter `__`); engine values are
read as JSON, else as a string, as `--engine-option` reads them. File: `engine = "NAME"` or an
`[engine]` table (`[wicore.engine]` when the keys sit under `[wicore]`).

A process started by another gets the parent's settings in a file (`write_settings_file`), not
through its environment.
"""

from __future__ import annotations

import json
import os
import tempfile
import tomllib
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SecretStr,
    SerializationInfo,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from wicore import defaults
from wicore.engines import ENGINES
from wicore.engines.options import FastOptions
from wicore.errors import ConfigError
from wicore.redaction import redact, split_password, with_password
from wicore.schemas import SamplingLimits

CONFIG_ENV = "WICORE_CONFIG"  # path of a TOML file; `--config` wins over it
ENGINE_NAMES = ("auto", *ENGINES)  # auto: fast on CUDA, else reference
# Settings a child process is not handed: the dashboard's login (no child serves the dashboard),
# and the Redis password, which redis_url carries already.
NOT_INHERITED = {"dashboard_auth", "redis_password", "redis_password_file"}
REVEAL_SECRETS = "reveal_secrets"  # a serialization context key: write the API keys themselves
_config_file: ContextVar[Path | None] = ContextVar("config_file", default=None)  # `--config`, while loading


class EngineSettings(FastOptions):
    """The `[engine]` section: which engine serves, and the fast engine's options. A bare string
    (`engine = "fast"`, `WICORE_ENGINE=fast`, `--engine fast`) is the name alone."""

    name: str = Field("auto", description="auto | fast | reference | null. Default auto: fast on CUDA, else reference.")

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @field_validator("name")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        if value not in ENGINE_NAMES:
            raise ValueError(f"unknown engine {value!r}; choose one of {', '.join(ENGINE_NAMES)}")
        return value

    def options(self) -> FastOptions:
        """The fast engine's options (the section less its name), validated once already: as the
        section was read."""
        return FastOptions.model_construct(**{name: getattr(self, name) for name in FastOptions.model_fields})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WICORE_", env_nested_delimiter="__", extra="forbid", frozen=True)

    # Kept comma-joined; `redis_urls` reads it as a list (producer/shards.py: one shard per URL).
    redis_url: str | None = None  # redis:// URL, or several comma-separated (or a TOML list): shards; None: embedded
    # The Redis password, when the URL does not carry it (so that it never shows in `ps`): given itself
    # (WICORE_REDIS_PASSWORD) or as a file holding it (`--redis-password-file`, WICORE_REDIS_PASSWORD_FILE).
    # Validation puts it into redis_url, which every connection is made from.
    redis_password: SecretStr | None = None
    redis_password_file: Path | None = None
    model: Path | None = None  # checkpoint directory; None: the bundled demo captioner
    model_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")  # name jobs use; default: from the dir
    engine: EngineSettings = EngineSettings()  # the engine and its options (`[engine]`, `WICORE_ENGINE__*`)
    device: str = "auto"  # cpu, cuda, cuda:1 ...; auto: cuda if available, else cpu
    # auto: bfloat16 on CUDA, float32 on CPU. fp8: bfloat16 with the engine option gemm_dtype = "fp8".
    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8"] = "auto"
    batch_size: int = Field(defaults.BATCH_SIZE, ge=1, le=4096)  # most jobs in one engine batch; 8
    max_queue_delay_ms: float = Field(defaults.MAX_QUEUE_DELAY_S * 1000, ge=0)  # a partial batch's longest wait; 5
    high_lane_slots: int | None = Field(None, ge=0)  # engine slots kept for high-priority jobs; batch_size // 16
    allowed_roots: list[Path] = []  # path-referenced images must live under one of these; none by default
    max_image_bytes: int = Field(defaults.MAX_IMAGE_BYTES, ge=1)  # an image's encoded size; 32 MiB
    max_image_pixels: int = Field(defaults.MAX_IMAGE_PIXELS, ge=1)  # width x height of an image; 50 M
    max_images_per_request: int = Field(defaults.MAX_IMAGES_PER_REQUEST, ge=0, le=1024)  # images in one job; 8
    max_n: int = Field(defaults.MAX_N, ge=1, le=128)  # samples one request may ask for (`n`); 16
    max_logprobs: int = Field(defaults.MAX_LOGPROBS, ge=0, le=1024)  # alternatives per token (`top_logprobs`); 20
    # Full-size pixel memory a worker's concurrent image decodes hold, in its threads or its decode
    # processes together; an image that needs more decodes alone. 512 MiB: two 50 Mpx RGB at once.
    decode_budget_bytes: int = Field(defaults.DECODE_BUDGET_BYTES, ge=2**20)
    # Images by URL (http(s)://, s3://) are fetched by the workers, never the gateway.
    allow_private_urls: bool = False  # fetch from private, loopback, unique-local addresses; off by default
    # The only hosts image URLs are fetched from, when given: names, '.example.com' (and its subdomains),
    # addresses or networks (10.0.0.0/8); they may be non-public. Link-local ones (169.254.169.254) only so.
    url_allow_hosts: Annotated[list[str], NoDecode] = []
    url_deny_hosts: Annotated[list[str], NoDecode] = []  # never fetched from (as url_allow_hosts); wins over it
    url_connect_timeout_s: float = Field(5.0, gt=0)  # connecting to an image URL's host; 5 s
    url_timeout_s: float = Field(30.0, gt=0)  # a whole fetch, redirects and body included; 30 s
    url_max_redirects: int = Field(3, ge=0, le=20)  # redirects an image URL may take, each checked again; 3
    # S3-compatible endpoint for s3:// images and dataset inputs (MinIO, R2 ...); none: AWS_ENDPOINT_URL(_S3), else AWS
    s3_endpoint_url: str | None = None
    # auto: the checkpoint's generation_config.json gives the defaults of the sampling parameters a request
    # leaves unset (temperature, top_p, top_k, max_new_tokens); none: wicore's own defaults.
    generation_config: Literal["auto", "none"] = "auto"
    # Processes a worker reads, decodes and resizes images in, off the GIL of the thread that launches
    # kernels (engines that take resized images: fast); 0: threads. Default: on a GPU one per two cores of the
    # worker's share of the host, at most 8 (`defaults.gpu_decode_processes`), else 0.
    decode_processes: int | None = Field(None, ge=0, le=256)
    liveness_ttl_s: float = Field(defaults.LIVENESS_TTL_S, gt=0)  # a silent worker is dead after this; 15 s
    result_ttl_s: int = Field(defaults.RESULT_TTL_S, ge=1)  # results live this long; one day
    retries: int = Field(defaults.RETRIES, ge=0)  # re-runs after a transient failure or a dead worker; 2
    cache_dir: Path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "wicore"  # built models
    no_cache: bool = False  # turn off the KV / vision-embedding caches; caches on by default
    vision_cache_redis_bytes: int = Field(2**30, ge=0)  # Redis-shared image embeddings (0 = not shared); 1 GiB
    vision_cache_ttl_s: float = Field(86_400, gt=0)  # a shared embedding lives this long unread; one day
    dashboard_auth: SecretStr | None = None  # USER:PASSWORD for `wicore dashboard`'s basic auth; none
    log_level: str = "WARNING"  # DEBUG | INFO | WARNING | ERROR
    # `wicore worker` samples its loop thread's stack and writes where it spent its time here (JSON,
    # `stack_sampler`) when it stops: what the host does while the device idles. None: off.
    sample_stacks: Path | None = None
    # The HTTP gateway (`wicore serve`) and the workers' Prometheus endpoints.
    host: str = "127.0.0.1"  # interface `wicore serve` and a worker's /metrics listen on
    port: int = Field(8000, ge=1, le=65535)  # `wicore serve`'s port; 8000
    metrics_port: int | None = Field(None, ge=1, le=65535)  # `wicore worker` serves /metrics and probes here; none: off
    api_keys: Annotated[list[SecretStr], NoDecode] = []  # bearer keys the gateway accepts; none: open
    max_request_bytes: int = Field(64 * 2**20, ge=1024)  # largest HTTP request body the gateway reads; 64 MiB
    request_timeout_s: float = Field(300.0, gt=0)  # longest a chat completion waits for its job; 5 min
    # A client connection's limits at `wicore serve`: its request's headers arrive within header_timeout_s
    # (else 408 and closed); a body that stalls body_timeout_s closes it; an idle keep-alive connection
    # closes after keep_alive_s; past max_connections open ones (lowered to fit the descriptor limit) a
    # new connection is answered 429 with Retry-After.
    header_timeout_s: float = Field(10.0, gt=0)  # 10 s
    body_timeout_s: float = Field(30.0, gt=0)  # 30 s
    keep_alive_s: float = Field(5.0, gt=0)  # 5 s
    max_connections: int = Field(2048, ge=1)  # 2048
    # OpenAI's Files and Batches at `wicore serve`: where files live (folder: under files_dir; redis: in
    # Redis, for small files; s3: under files_s3_url, at s3_endpoint_url, with the standard AWS credentials),
    # the largest upload (an upload is a request too: max_request_bytes bounds it as well), and how long a
    # batch's "24h" completion window really lasts (lines not done by then expire).
    files_store: Literal["folder", "redis", "s3"] = "folder"  # folder
    files_dir: Path = Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local/share")) / "wicore"  # batch files
    files_s3_url: str | None = None  # the s3 store's s3://bucket/prefix; the bucket must exist
    files_s3_timeout_s: float = Field(10.0, gt=0)  # the s3 store: connecting, and each read of an answer; 10 s
    max_file_bytes: int = Field(64 * 2**20, ge=1)  # 64 MiB
    batch_window_s: float = Field(86_400.0, gt=0)  # one day
    # Flow control of bulk runs (`wicore caption`, `wicore enqueue`): the window they keep in Redis (cli/submitting.py).
    window_jobs: int = Field(defaults.WINDOW_JOBS, ge=1)  # a bulk run's unfinished jobs in Redis, at most; 2048
    # Their image bytes in Redis, at most (0: no bound); `wicore caption` allows this per worker it starts. 512 MiB
    window_bytes: int = Field(defaults.WINDOW_BYTES, ge=0)
    # Admission control (producer/admission.py): past the cap, HTTP 429 with Retry-After, QueueFull from the Producer.
    max_queued_jobs: int = Field(defaults.MAX_QUEUED_JOBS, ge=0)  # queued jobs per model and lane (0: none); 100000
    max_queued_high_jobs: int = Field(defaults.MAX_QUEUED_HIGH_JOBS, ge=0)  # the high lane's own cap (0: none); 1000

    @property
    def sampling_limits(self) -> SamplingLimits:
        return SamplingLimits(max_n=self.max_n, max_logprobs=self.max_logprobs)

    @property
    def s3_endpoint(self) -> str | None:
        """The S3 endpoint s3:// URLs are read from: the setting, else the AWS SDKs' variables
        AWS_ENDPOINT_URL_S3 and AWS_ENDPOINT_URL, else None (AWS itself)."""
        return (
            self.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        )

    @model_validator(mode="before")
    @classmethod
    def _password_into_url(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        password = given_password(data.get("redis_password"), data.get("redis_password_file"))
        if password is None or not data.get("redis_url"):
            return data
        given = data["redis_url"]
        urls = given if isinstance(given, list | tuple) else str(given).split(",")
        return {**data, "redis_url": ",".join(_with_given_password(str(url).strip(), password) for url in urls)}

    @field_validator("redis_url", mode="before")
    @classmethod
    def _shard_list(cls, value: Any) -> Any:
        """['redis://a', 'redis://b'] or 'redis://a, redis://b' -> 'redis://a,redis://b'."""
        urls = value if isinstance(value, list | tuple) else str(value).split(",") if value is not None else None
        if urls is None:
            return None
        urls = [str(url).strip() for url in urls if str(url).strip()]
        if not urls:
            raise ValueError("give at least one Redis URL")
        return ",".join(urls)

    @property
    def redis_urls(self) -> list[str]:
        """The Redis shards, in order (one for a single Redis); [] for the embedded one."""
        return self.redis_url.split(",") if self.redis_url else []

    @field_validator("high_lane_slots")
    @classmethod
    def _other_lanes_keep_a_slot(cls, value: int | None, info: ValidationInfo) -> int | None:
        batch_size = info.data.get("batch_size")  # absent when it failed its own check
        if value is not None and batch_size is not None and value >= batch_size:
            raise ValueError(f"must be below batch_size ({batch_size}): the other lanes need a slot, got {value}")
        return value

    @field_validator("api_keys", "url_allow_hosts", "url_deny_hosts", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """WICORE_API_KEYS=key1,key2, WICORE_URL_ALLOW_HOSTS=a.example.com,10.0.0.0/8 (the TOML
        file and flags give lists)."""
        return [k.strip() for k in value.split(",") if k.strip()] if isinstance(value, str) else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, Environment(settings_cls), TomlFile(settings_cls))

    @field_serializer("api_keys", when_used="json")
    def _masked_keys(self, keys: list[SecretStr], info: SerializationInfo) -> list[str]:
        """'***' per key in JSON (logs, `public`); the keys themselves only when the context
        asks for them (`write_settings_file`)."""
        reveal = bool(info.context and info.context.get(REVEAL_SECRETS))
        return [key.get_secret_value() if reveal else "***" for key in keys]

    def public(self) -> dict[str, Any]:
        """The settings as JSON-able values, fit for a log: the Redis URL's password and the API
        keys are masked."""
        values = self.model_dump(mode="json")
        if self.redis_url:
            values["redis_url"] = redact(self.redis_url)
        return values


def _with_given_password(url: str, password: str) -> str:
    bare, in_url = split_password(url)
    if in_url is not None:
        raise ValueError("the Redis password is given twice: in redis_url and as redis_password(_file)")
    return with_password(bare, password)


def given_password(password: Any, password_file: Any) -> str | None:
    """The password from `redis_password` or the first line of `redis_password_file`."""
    if password is not None and password_file is not None:
        raise ValueError("give redis_password or redis_password_file, not both")
    if password_file is not None:
        try:
            lines = Path(password_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read redis_password_file {password_file}: {exc}") from None
        if not lines or not lines[0]:
            raise ValueError(f"redis_password_file {password_file} is empty: write the password on its first line")
        return lines[0]
    if isinstance(password, SecretStr):
        return password.get_secret_value()
    return password


class Environment(EnvSettingsSource):
    """`WICORE_*`, nested keys after `__`. `WICORE_ENGINE=NAME` is the engine's name; the other
    engine values are read as JSON, else as a string (the engine `null` is a name, not None)."""

    def prepare_field_value(self, field_name: str, field, value: Any, value_is_complex: bool) -> Any:
        if field_name == "engine" and isinstance(value, str) and not value.lstrip().startswith("{"):
            value = json.dumps({"name": value})
        prepared = super().prepare_field_value(field_name, field, value, value_is_complex)
        if field_name == "engine" and isinstance(prepared, dict):
            prepared = {key: raw if key == "name" else json_or_text(raw) for key, raw in prepared.items()}
        return prepared


class TomlFile(PydanticBaseSettingsSource):
    """The `[wicore]` table (or the top level) of the file given by `--config` or WICORE_CONFIG."""

    def get_field_value(self, field, field_name):  # required by the base class; unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _config_file.get() or os.environ.get(CONFIG_ENV)
        if not path:
            return {}
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        data = data.get("wicore", data)
        if isinstance(data.get("engine"), str):  # merges with engine keys from other sources
            data["engine"] = {"name": data["engine"]}
        return data


def json_or_text(raw: Any) -> Any:
    """'16' -> 16, 'false' -> False, '[1, 2]' -> [1, 2], '/tmp/kv' -> '/tmp/kv'."""
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def environment_names() -> set[str]:
    """Every WICORE_ variable a setting is read from, nested engine keys included."""
    names = {"WICORE_" + name.upper() for name in Settings.model_fields} | {CONFIG_ENV}
    return names | {"WICORE_ENGINE__" + name.upper() for name in EngineSettings.model_fields}


def check_environment() -> None:
    """A misspelt WICORE_ variable is an error, not a silently ignored setting."""
    known = environment_names()
    unknown = sorted(k for k in os.environ if k.upper().startswith("WICORE_") and k.upper() not in known)
    if unknown:
        raise ConfigError(f"unknown environment setting(s): {', '.join(unknown)}")


def load_settings(config: Path | None = None, *, engine_options: dict | None = None, **flags: Any) -> Settings:
    """Settings with the flags that were given (None = not given) on top. `config`: the TOML
    file of `--config` (else WICORE_CONFIG's); `engine_options`: `--engine-option` pairs."""
    check_environment()
    token = _config_file.set(config)
    try:
        given = _given(flags, engine_options)
        return _validated(lambda: Settings(**given))
    finally:
        _config_file.reset(token)


def _given(flags: dict[str, Any], engine_options: dict | None) -> dict[str, Any]:
    given = {k: v for k, v in flags.items() if v is not None}
    engine = {"name": given.pop("engine")} if "engine" in given else {}
    engine.update(engine_options or {})
    if engine:  # a dict, so that it merges with the engine keys of the environment and the file
        given["engine"] = engine
    return given


def _validated(build: Callable[[], Settings]) -> Settings:
    try:
        return build()
    except ValidationError as exc:
        raise ConfigError.from_validation(exc, Settings) from None


def write_settings_file(settings: Settings, folder: Path) -> Path:
    """The settings in a JSON file only this user can read (it may hold a Redis password): what a
    child process is started with instead of the parent's environment. The API keys are written
    themselves (a child gateway needs them); the dashboard's login is left out (`NOT_INHERITED`)."""
    fd, name = tempfile.mkstemp(prefix="settings-", suffix=".json", dir=folder)  # mode 0600
    with os.fdopen(fd, "w") as sink:
        sink.write(settings.model_dump_json(exclude=NOT_INHERITED, context={REVEAL_SECRETS: True}))
    return Path(name)


def read_settings_file(path: Path, *, engine_options: dict | None = None, **flags: Any) -> Settings:
    """Settings from `write_settings_file`, with flags on top. Neither the environment nor a
    config file is read: the parent already merged them."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read settings file {path}: {exc}") from exc
    given = _given(flags, engine_options)
    engine = {**values.get("engine", {}), **given.pop("engine", {})}
    return _validated(lambda: Settings.model_validate({**values, **given, "engine": engine}))
