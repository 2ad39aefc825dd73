"""Settings: one typed tree from flags, `WICORE_*` environment (nested engine keys) and the TOML
file; loud errors; children get theirs explicitly. Real files and real processes."""

from __future__ import annotations

import json
import os
import stat

import pytest
from redis import Redis

from tests.helpers import wicore, write_images
from wicore.cli.common import settings_from
from wicore.config import load_settings, read_settings_file, write_settings_file
from wicore.embedded import EmbeddedRedis
from wicore.errors import ConfigError
from wicore.redaction import redact, split_password


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No WICORE_ variable of the shell that runs the tests leaks into these."""
    for name in [k for k in os.environ if k.upper().startswith("WICORE_")]:
        monkeypatch.delenv(name)


def toml(tmp_path, text: str):
    path = tmp_path / "wicore.toml"
    path.write_text(text)
    return path


def test_defaults():
    settings = load_settings()
    assert settings.engine.name == "auto" and settings.engine.vision_batch_size is None
    assert settings.engine.block_size == 16 and settings.liveness_ttl_s == 15.0 and settings.result_ttl_s == 86_400


@pytest.mark.parametrize(
    "text",
    [
        '[engine]\nname = "fast"\nvision_batch_size = 4\n',
        '[wicore]\nbatch_size = 8\n[wicore.engine]\nname = "fast"\nvision_batch_size = 4\n',
        'engine = { name = "fast", vision_batch_size = 4 }\n',
    ],
)
def test_engine_options_from_the_file(tmp_path, text):
    settings = load_settings(toml(tmp_path, text))
    assert settings.engine.name == "fast" and settings.engine.vision_batch_size == 4
    assert settings.engine.options().vision_batch_size == 4


def test_engine_name_alone_from_the_file_and_the_environment(tmp_path, monkeypatch):
    assert load_settings(toml(tmp_path, 'engine = "reference"\n')).engine.name == "reference"
    monkeypatch.setenv("WICORE_ENGINE", "null")
    assert load_settings().engine.name == "null"


def test_engine_options_from_nested_environment(monkeypatch):
    monkeypatch.setenv("WICORE_ENGINE", "fast")
    monkeypatch.setenv("WICORE_ENGINE__VISION_BATCH_SIZE", "16")
    monkeypatch.setenv("WICORE_ENGINE__CUDA_GRAPHS", "false")
    monkeypatch.setenv("WICORE_ENGINE__GRAPH_BATCH_SIZES", "[4, 1]")
    monkeypatch.setenv("WICORE_ENGINE__DISK_CACHE_DIR", "/tmp/kv")
    engine = load_settings().engine
    assert (engine.name, engine.vision_batch_size, engine.cuda_graphs) == ("fast", 16, False)
    assert engine.graph_batch_sizes == (4, 1) and engine.disk_cache_dir == "/tmp/kv"


def test_engine_options_from_flags():
    settings = settings_from(None, engine="fast", engine_option=["vision_batch_size=16", "cache_policy=lru"])
    assert (settings.engine.name, settings.engine.vision_batch_size, settings.engine.cache_policy) == (
        "fast",
        16,
        "lru",
    )


def test_fp8_from_the_dtype_flag_the_environment_and_the_file(tmp_path, monkeypatch):
    from wicore.worker.factory import fast_options, resolve_dtype

    for settings in (
        settings_from(None, dtype="fp8"),
        settings_from(None, engine_option=["gemm_dtype=fp8"], dtype="bfloat16"),
        load_settings(toml(tmp_path, '[engine]\ngemm_dtype = "fp8"\n'), dtype="bfloat16"),
    ):
        assert fast_options(settings).gemm_dtype == "fp8" and resolve_dtype(settings.dtype, "cuda") == "bfloat16"
    monkeypatch.setenv("WICORE_DTYPE", "fp8")
    assert fast_options(load_settings()).gemm_dtype == "fp8"
    assert fast_options(settings_from(None, dtype="bfloat16")).gemm_dtype == "model"  # the flag wins
    with pytest.raises(ConfigError, match="gemm_dtype"):
        settings_from(None, engine_option=["gemm_dtype=fp16"])


def test_precedence_is_flags_then_environment_then_file_then_defaults_key_by_key(tmp_path, monkeypatch):
    path = toml(tmp_path, "[engine]\nvision_batch_size = 1\nblock_size = 8\nmax_model_len = 512\n")
    monkeypatch.setenv("WICORE_ENGINE__VISION_BATCH_SIZE", "2")
    monkeypatch.setenv("WICORE_ENGINE__BLOCK_SIZE", "32")
    engine = load_settings(path, engine_options={"vision_batch_size": 3}).engine
    assert engine.vision_batch_size == 3  # flag over environment over file
    assert engine.block_size == 32  # environment over file
    assert engine.max_model_len == 512  # file over default
    assert engine.torch_threads is None and engine.name == "auto"  # defaults
    assert load_settings(path, engine="fast").engine.vision_batch_size == 2, "a name flag keeps the other keys"


@pytest.mark.parametrize(
    "where",
    ["file", "environment", "flag"],
)
def test_an_unknown_engine_key_is_an_error(tmp_path, monkeypatch, where):
    path = toml(tmp_path, "[engine]\nblok_size = 8\n") if where == "file" else None
    if where == "environment":
        monkeypatch.setenv("WICORE_ENGINE__BLOK_SIZE", "8")
    flags = {"blok_size": 8} if where == "flag" else None
    with pytest.raises(ConfigError, match="(?i)blok_size"):
        load_settings(path, engine_options=flags)


def test_unknown_top_level_keys_stay_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="batch_sise"):
        load_settings(toml(tmp_path, "batch_sise = 4\n"))
    monkeypatch.setenv("WICORE_BATCH_SISE", "4")
    with pytest.raises(ConfigError, match="WICORE_BATCH_SISE"):
        load_settings()


@pytest.mark.parametrize(
    ("source", "key"),
    [
        ("WICORE_ENGINE__BLOCK_SIZE=12", "engine.block_size"),
        ("WICORE_ENGINE__PREFIX_CACHE=yes", "engine.prefix_cache"),
        ("WICORE_ENGINE=turbo", "engine.name"),
        ("WICORE_BATCH_SIZE=0", "batch_size"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_key(monkeypatch, source, key):
    name, _, value = source.partition("=")
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as error:
        load_settings()
    assert key in str(error.value) and "\n" not in str(error.value)


def test_the_cli_reports_a_bad_engine_option_in_one_line():
    done = wicore("worker", "--redis-url", "redis://127.0.0.1:1/0", "--engine-option", "block_size=12", check=False)
    assert done.returncode == 2 and "engine.block_size" in done.stderr and "power of two" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_config_file_flag_leaves_the_environment_alone(tmp_path):
    settings = settings_from(toml(tmp_path, "[engine]\nvision_batch_size = 4\n"))
    assert settings.engine.vision_batch_size == 4 and "WICORE_CONFIG" not in os.environ


def test_settings_file_round_trip_ignores_the_environment(tmp_path, monkeypatch):
    settings = load_settings(
        redis_url="redis://:secret@127.0.0.1:1/0", api_keys=["k-1"], engine="fast", engine_options={"block_size": 4}
    )
    path = write_settings_file(settings, tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600, "it may hold a Redis password and API keys"
    monkeypatch.setenv("WICORE_ENGINE__BLOCK_SIZE", "64")
    monkeypatch.setenv("WICORE_BATCH_SIZE", "3")
    assert read_settings_file(path) == settings
    assert read_settings_file(path, batch_size=5, engine_options={"vision_batch_size": 2}).engine.block_size == 4


def test_the_dashboard_login_stays_out_of_settings_files_and_error_lines(tmp_path):
    settings = load_settings(dashboard_auth="admin:hunter2")
    path = write_settings_file(settings, tmp_path)
    assert "hunter2" not in path.read_text() and "*****" not in path.read_text()
    assert read_settings_file(path).dashboard_auth is None
    with pytest.raises(ConfigError) as error:
        load_settings(toml(tmp_path, "dashboard_auth = 314159\n"))
    assert "dashboard_auth" in str(error.value) and "314159" not in str(error.value)


def test_credentials_are_masked():
    assert redact("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("rediss://:secret@host/0?password=also&ssl_cert_reqs=none") == (
        "rediss://:***@host/0?password=***&ssl_cert_reqs=none"
    )
    assert redact("redis://host/0?db=1&Password=secret") == "redis://host/0?db=1&Password=***"
    assert redact("unix://:secret@/run/redis.sock") == "unix://:***@/run/redis.sock"
    assert redact("redis://host/0") == "redis://host/0"
    for url in ("redis://:secret@127.0.0.1:1/0", "redis://127.0.0.1:1/0?password=secret"):
        public = load_settings(redis_url=url, api_keys=["key-secret"]).public()
        assert "secret" not in json.dumps(public) and public["api_keys"] == ["***"]


def test_a_url_splits_into_its_password_and_the_rest():
    assert split_password("redis://u:p%40ss@h:1/0?password=x&db=2") == ("redis://u@h:1/0?db=2", "p@ss")
    assert split_password("rediss://h/0?password=x") == ("rediss://h/0", "x")
    assert split_password("unix://:pw@/run/r.sock") == ("unix:///run/r.sock", "pw")
    assert split_password("redis://h/0") == ("redis://h/0", None)


def test_the_redis_password_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    secret = tmp_path / "redis-password"
    secret.write_text("p@ss/word\n")
    by_file = load_settings(redis_url="redis://h:6379/0", redis_password_file=secret)
    assert by_file.redis_url == "redis://:p%40ss%2Fword@h:6379/0"
    assert "p@ss" not in json.dumps(by_file.public()) and "p%40ss" not in json.dumps(by_file.public())
    child = read_settings_file(write_settings_file(by_file, tmp_path))
    assert child.redis_url == by_file.redis_url and child.redis_password_file is None
    monkeypatch.setenv("WICORE_REDIS_PASSWORD", "from-env")
    assert load_settings(redis_url="redis://u@h/0").redis_url == "redis://u:from-env@h/0"
    assert load_settings().redis_url is None, "no URL: nothing to put the password in"
    empty = tmp_path / "empty"
    empty.write_text("")
    for flags, says in (
        ({"redis_url": "redis://h/0", "redis_password_file": secret}, "not both"),
        ({"redis_url": "redis://:other@h/0"}, "given twice"),
        ({"redis_url": "redis://h/0?password=other"}, "given twice"),
    ):
        with pytest.raises(ConfigError, match=says) as error:
            load_settings(**flags)
        assert "from-env" not in str(error.value) and "other" not in str(error.value)
    monkeypatch.delenv("WICORE_REDIS_PASSWORD")
    for path, says in ((empty, "is empty"), (tmp_path / "missing", "cannot read")):
        with pytest.raises(ConfigError, match=says):
            load_settings(redis_url="redis://h/0", redis_password_file=path)


def test_api_keys_from_the_environment_are_comma_separated(monkeypatch):
    monkeypatch.setenv("WICORE_API_KEYS", "k1, k2,")
    assert [key.get_secret_value() for key in load_settings().api_keys] == ["k1", "k2"]


@pytest.mark.slow
def test_the_worker_logs_its_resolved_config_once_without_the_password(tmp_path, tiny_model_dir):
    with EmbeddedRedis() as server:
        Redis.from_url(server.url).config_set("requirepass", "sesame")
        url = server.url.replace("redis://", "redis://:sesame@")
        done = wicore("worker", "--redis-url", url, "--model", str(tiny_model_dir), "--engine", "fast", "--burst",
                      env={"WICORE_LOG_LEVEL": "INFO", "WICORE_API_KEYS": "open-sesame"})  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if "config: {" in line]
    assert len(lines) == 1 and "sesame" not in done.stdout + done.stderr
    config = json.loads(lines[0].split("config: ", 1)[1])
    assert config["settings"]["redis_url"].startswith("redis://:***@")
    assert config["settings"]["api_keys"] == ["***"]
    assert config["worker"]["decode_processes"] == 0, "on CPU images decode in threads by default"
    engine = config["engine"]
    assert (engine["name"], engine["vision_batch_size"], engine["compile_text"], engine["cuda_graphs"]) == (
        "fast",
        8,
        False,
        False,
    )


@pytest.mark.slow
def test_caption_workers_honour_an_engine_option_of_the_config_file(tmp_path, tiny_model_dir):
    """The file reaches `wicore caption` by --config only: its workers get the settings in a
    file of their own, not through WICORE_CONFIG."""
    write_images(tmp_path / "imgs", 3)
    path = toml(
        tmp_path, f'log_level = "INFO"\nmodel = "{tiny_model_dir}"\n[engine]\nname = "fast"\nmax_model_len = 16\n'
    )
    out, cache = tmp_path / "out.jsonl", tmp_path / "cache"
    run = wicore(
        "caption",
        str(tmp_path / "imgs"),
        "-o",
        str(out),
        "--config",
        str(path),
        env={"XDG_CACHE_HOME": str(cache)},
        check=False,
    )
    assert run.returncode == 1  # every input got an error line
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3 and all(line["error"].startswith("PromptTooLong") for line in lines)
    assert all("max_model_len 16" in line["error"] for line in lines)
    [log] = (cache / "wicore" / "logs").glob("caption-*/*.log")
    config = json.loads(next(li for li in log.read_text().splitlines() if "config: {" in li).split("config: ", 1)[1])
    assert config["engine"]["max_model_len"] == 16 and config["settings"]["engine"]["name"] == "fast"


def test_high_lane_slots_leave_the_other_lanes_a_slot():
    assert load_settings(batch_size=8, high_lane_slots=7).high_lane_slots == 7
    assert load_settings(batch_size=8).high_lane_slots is None, "the policy's default: batch_size // 16"
    with pytest.raises(
        ConfigError, match=r"^bad configuration: setting high_lane_slots: must be below batch_size \(4\)"
    ):
        load_settings(batch_size=4, high_lane_slots=4)


def test_every_verb_takes_the_redis_password_from_a_file(tmp_path):
    """Not on the command line (`ps` shows it), not in any output."""
    with EmbeddedRedis(password="sesame-file") as server:
        bare = server.url.replace(":sesame-file@", "")
        secret = tmp_path / "pw"
        secret.write_text("sesame-file\n")
        status = wicore("status", "--redis-url", bare, "--redis-password-file", str(secret), "--json")
        by_env = wicore("status", "--redis-url", bare, "--json", env={"WICORE_REDIS_PASSWORD_FILE": str(secret)})
        refused = wicore("status", "--redis-url", bare, check=False)
    assert "sesame" not in status.stdout + status.stderr + by_env.stdout + by_env.stderr
    assert refused.returncode == 4 and "wants a password" in refused.stderr
    import typer.main

    from wicore.cli.main import app

    commands = typer.main.get_command(app).commands
    takes_url = sorted(name for name, cmd in commands.items() if any("--redis-url" in p.opts for p in cmd.params))
    assert takes_url == ["cancel", "caption", "dashboard", "enqueue", "result", "serve", "status", "worker"]
    for name in takes_url:
        assert any("--redis-password-file" in p.opts for p in commands[name].params), name


def test_redis_url_lists_shards_from_the_environment_a_file_or_a_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("WICORE_REDIS_URL", "redis://a:6379/0, redis://b:6379/0")
    assert load_settings().redis_urls == ["redis://a:6379/0", "redis://b:6379/0"]
    config = tmp_path / "wicore.toml"
    config.write_text('redis_url = ["redis://c:6379/0", "redis://d:6379/1"]\n')
    monkeypatch.delenv("WICORE_REDIS_URL")
    assert load_settings(config).redis_urls == ["redis://c:6379/0", "redis://d:6379/1"]
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    both = load_settings(redis_url="redis://a:6379/0,redis://b:6379/0", redis_password_file=secret)
    assert both.redis_urls == ["redis://:s3cret@a:6379/0", "redis://:s3cret@b:6379/0"]
    assert "s3cret" not in json.dumps(both.public())
    assert load_settings().redis_urls == []
