"""Settings shared by every verb: flags > environment (`WICORE_*`) > config file (TOML) >
defaults. Unknown keys fail loudly, in the file and in the environment alike."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from wicore.errors import ConfigError

CONFIG_ENV = "WICORE_CONFIG"  # path of a TOML file; `--config` sets it too


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WICORE_", extra="forbid", frozen=True)

    redis_url: str | None = None  # None: `wicore caption` starts an embedded redis-server
    model: Path | None = None  # checkpoint directory; None: the bundled demo captioner
    model_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")  # default: from the dir
    engine: str = "auto"  # auto: fast on CUDA, reference on CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bfloat16 on CUDA
    batch_size: int = Field(8, ge=1, le=4096)
    max_queue_delay_ms: float = Field(5.0, ge=0)
    allowed_roots: list[Path] = []  # path-referenced images must live under one of these
    max_image_bytes: int = Field(32 * 2**20, ge=1)
    max_image_pixels: int = Field(50_000_000, ge=1)
    liveness_ttl_s: float = Field(15.0, gt=0)
    result_ttl_s: int = Field(86_400, ge=1)
    retries: int = Field(2, ge=0)
    cache_dir: Path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "wicore"
    no_cache: bool = False  # turn off the KV / vision-embedding caches
    vision_cache_redis_bytes: int = Field(2**30, ge=0)  # Redis-shared image embeddings (0 = not shared)
    vision_cache_ttl_s: float = Field(86_400, gt=0)
    log_level: str = "WARNING"
    # The HTTP gateway (`wicore serve`) and the workers' Prometheus endpoints.
    host: str = "127.0.0.1"  # interface `wicore serve` and a worker's metrics listen on
    port: int = Field(8000, ge=1, le=65535)  # `wicore serve`
    metrics_port: int | None = Field(None, ge=1, le=65535)  # `wicore worker`: serve /metrics here
    api_keys: Annotated[list[SecretStr], NoDecode] = []  # bearer keys the gateway accepts (none: open)
    max_request_bytes: int = Field(64 * 2**20, ge=1024)  # largest HTTP request body the gateway reads
    request_timeout_s: float = Field(300.0, gt=0)  # longest a chat completion waits for its job

    @field_validator("api_keys", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """WICORE_API_KEYS=key1,key2 (the TOML file and flags give lists)."""
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
        return (init_settings, env_settings, TomlFile(settings_cls))


class TomlFile(PydanticBaseSettingsSource):
    """The `[wicore]` table (or the top level) of the file named by WICORE_CONFIG."""

    def get_field_value(self, field, field_name):  # required by the base class; unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get(CONFIG_ENV)
        if not path:
            return {}
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        return data.get("wicore", data)


def check_environment() -> None:
    """A misspelt WICORE_ variable is an error, not a silently ignored setting."""
    known = {"WICORE_" + name.upper() for name in Settings.model_fields} | {CONFIG_ENV}
    unknown = sorted(k for k in os.environ if k.startswith("WICORE_") and k not in known)
    if unknown:
        raise ConfigError(f"unknown environment setting(s): {', '.join(unknown)}")


def load_settings(**flags: Any) -> Settings:
    """Settings with the flags that were given (None = not given) on top."""
    check_environment()
    given = {k: v for k, v in flags.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        raise ConfigError(f"bad configuration:\n{exc}") from exc
