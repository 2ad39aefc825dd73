"""Every user-facing failure of the installed `wicore` command: one line on stderr saying what is
wrong and what to do, its exit code, and never a password. Real redis-servers, one of them
password-protected (requirepass); nothing here loads a model."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import torch
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from tests.helpers import wicore, without, write_images
from wicore.embedded import EmbeddedRedis, free_port
from wicore.redaction import redact

PASSWORD = "s3cret-Pw-for-the-tests"
USAGE, REDIS = 2, 4


@pytest.fixture(scope="module")
def locked():
    with EmbeddedRedis(password=PASSWORD) as server:
        yield server


@pytest.fixture
def env(tmp_path):
    return {"XDG_CACHE_HOME": str(tmp_path / "cache")}


def fails(*args: str, code: int, says: str, env: dict | None = None) -> str:
    """Run `wicore ARGS`; it must exit `code` with exactly one stderr line containing `says`."""
    run = wicore(*args, env=env, check=False, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == code, run.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], run.stderr
    assert PASSWORD not in run.stdout + run.stderr
    return lines[0]


@pytest.fixture
def image(tmp_path):
    return str(write_images(tmp_path / "imgs", 1)[0])


@pytest.fixture
def unloadable_model(tmp_path):
    """Passes the cheap checks (config.json, a weights file) but cannot load: a worker that
    reported this instead of a Redis problem would have loaded the model before Redis."""
    folder = tmp_path / "broken-model"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    (folder / "model.safetensors").write_bytes(b"not weights")
    return str(folder)


def redis_cases(locked) -> dict[str, tuple[str, int, str]]:
    bare = locked.url.replace(f":{PASSWORD}@", "")
    return {
        "refused": (f"redis://127.0.0.1:{free_port()}/0", REDIS, "cannot reach Redis at redis://127.0.0.1:"),
        "http": ("http://127.0.0.1:6379/0", USAGE, "is not a Redis URL"),
        "no password": (bare, REDIS, f"Redis at {bare} wants a password"),
        "wrong password": (bare.replace("redis://", "redis://:wrong-one@"), REDIS, "refused the user name or password"),
    }


@pytest.mark.parametrize("case", ["refused", "http", "no password", "wrong password"])
@pytest.mark.parametrize("verb", ["status", "enqueue", "result", "worker"])
def test_redis_problems_are_one_line(verb, case, locked, image, unloadable_model, env):
    url, code, says = redis_cases(locked)[case]
    args = {"status": [], "enqueue": [image], "result": ["wc-0"], "worker": ["--model", unloadable_model]}[verb]
    line = fails(verb, *args, "--redis-url", url, code=code, says=says, env=env)
    assert "wrong-one" not in line, "a wrong password is not shown either"


def test_without_a_redis_url_the_service_verbs_say_how_to_give_one(image, env):
    for verb in ("status", "enqueue", "worker"):
        fails(verb, *([image] if verb == "enqueue" else []), code=USAGE, says="pass --redis-url", env=env)


def test_the_password_protected_server_works_with_its_url(locked, env):
    status = json.loads(wicore("status", "--json", "--redis-url", locked.url, env=env).stdout)
    assert status == {"queues": [], "workers": []}


def test_config_errors_are_one_line_without_pydantic_noise(tmp_path, env):
    toml = tmp_path / "wicore.toml"
    toml.write_text(f'redis_url = "redis://:{PASSWORD}@127.0.0.1:1/0"\nbatch_size = "many"\nbatchsize = 3\n')
    line = fails("status", "--config", str(toml), code=USAGE, says="bad configuration: setting batch_size:", env=env)
    assert "unknown setting 'batchsize'" in line and "pydantic.dev" not in line
    fails("status", code=USAGE, says="batch_size: Input should be greater than", env={**env, "WICORE_BATCH_SIZE": "0"})
    fails("status", code=USAGE, says="WICORE_BATCHSIZE", env={**env, "WICORE_BATCHSIZE": "3"})
    (tmp_path / "bad.toml").write_text("redis_url = \n")
    fails("status", "--config", str(tmp_path / "bad.toml"), code=USAGE, says="cannot read config file", env=env)


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("WICORE_MAX_IMAGES_PER_REQUEST", "-1", "max_images_per_request: Input should be greater than or equal to 0"),
        ("WICORE_URL_TIMEOUT_S", "0", "url_timeout_s: Input should be greater than 0"),
        ("WICORE_URL_CONNECT_TIMEOUT_S", "soon", "url_connect_timeout_s: Input should be a valid number"),
        ("WICORE_URL_MAX_REDIRECTS", "50", "url_max_redirects: Input should be less than or equal to 20"),
        ("WICORE_GENERATION_CONFIG", "sometimes", "generation_config: Input should be 'auto' or 'none'"),
        ("WICORE_ALLOW_PRIVATE_URLS", "perhaps", "allow_private_urls: Input should be a valid boolean"),
    ],
)
def test_the_request_settings_bad_values_are_one_line(variable, value, says, env):
    fails("status", code=USAGE, says=says, env={**env, variable: value})


def test_usage_errors_are_one_line(env):
    fails("caption", "--no-such-flag", code=USAGE, says="No such option: --no-such-flag", env=env)
    fails("result", code=USAGE, says="Missing argument", env=env)
    fails("schema", "nope", code=USAGE, says="'nope' is not one of 'manifest', 'result'", env=env)


def test_debug_shows_the_traceback_before_the_line(env):
    url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    for extra, more_env in ((["--debug"], {}), ([], {"WICORE_LOG_LEVEL": "debug"})):
        run = wicore("status", "--redis-url", url, *extra, env={**env, **more_env}, check=False)
        assert run.returncode == REDIS and "Traceback (most recent call last)" in run.stderr
        assert run.stderr.strip().splitlines()[-1].startswith("error: cannot reach Redis at redis://:***@127.0.0.1")
        assert PASSWORD not in run.stderr + run.stdout


def test_missing_inputs_are_an_error_before_anything_starts(tmp_path, locked, env):
    out = tmp_path / "out.jsonl"
    fails(
        "caption", "photos/", str(tmp_path), "-o", str(out), code=USAGE, says="no such file or folder: photos/", env=env
    )
    assert not out.exists()
    fails(
        "enqueue", "nope.jpg", "--redis-url", locked.url, code=USAGE, says="no such file or folder: nope.jpg", env=env
    )


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--max-new-tokens", "0", "Invalid value for '--max-new-tokens'"),
        ("--max-new-tokens", "40000", "Invalid value for '--max-new-tokens'"),
        ("--temperature", "-1", "Invalid value for '--temperature'"),
        ("--seed", "-2", "Invalid value for '--seed'"),
    ],
)
def test_out_of_range_generation_flags_are_usage_errors(image, locked, env, flag, value, says):
    fails("enqueue", image, flag, value, "--redis-url", locked.url, code=USAGE, says=says, env=env)


def test_a_bad_image_url_is_its_inputs_warning(locked, env):
    # an s3:// INPUT named like an image is one image URL (other s3:// INPUTs are dataset prefixes)
    run = wicore("enqueue", "s3://bucket-only.jpg", "--redis-url", locked.url, env=env, check=False)
    assert run.returncode == 1
    assert (
        "warning: not enqueued: s3://bucket-only.jpg: InputError: s3://bucket-only.jpg: an s3:// URL needs a key"
        in (run.stdout + run.stderr)
    )


def test_an_output_folder_that_does_not_exist_is_a_usage_error(tmp_path, image, env):
    out = tmp_path / "no-such-folder" / "out.jsonl"
    fails("caption", image, "-o", str(out), code=USAGE, says=f"the folder {out.parent} does not exist", env=env)
    assert not out.parent.exists()


def test_a_database_index_out_of_range_is_named(locked, env):
    url = locked.url.rsplit("/", 1)[0] + "/99"
    line = fails("status", "--redis-url", url, code=REDIS, says="has no database 99", env=env)
    assert "memory limit" not in line


def test_serve_on_a_busy_port_names_the_port_and_starts_nothing(locked, env):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        run = wicore("serve", "--redis-url", locked.url, "--port", str(port), env=env, check=False, timeout=120)
    assert run.returncode == USAGE, run.stderr
    assert (
        run.stderr.strip().splitlines() == [run.stderr.strip()] and f"cannot listen on 127.0.0.1:{port}" in run.stderr
    )
    assert "gateway on" not in run.stdout + run.stderr


def test_model_problems_are_one_line(tmp_path, image, locked, env):
    out = str(tmp_path / "out.jsonl")
    for verb, args in (("caption", [image, "-o", out]), ("worker", ["--redis-url", locked.url])):
        fails(
            verb, *args, "--model", "/nonexistent", code=USAGE, says="--model /nonexistent: no such directory", env=env
        )
        fails(verb, *args, "--engine", "turbo", code=USAGE, says="unknown engine 'turbo'; choose one of auto,", env=env)
    assert not (tmp_path / "out.jsonl").exists()


def test_a_checkpoint_without_weights_is_refused_unless_asked(tmp_path, image, locked, env):
    model = tmp_path / "gemma3-4b"
    wicore("make-model", "gemma3-4b", str(model), env=env)
    out = str(tmp_path / "out.jsonl")
    says = "has a config but no weights (*.safetensors): it would run random weights"
    fails("caption", image, "-o", out, "--model", str(model), code=USAGE, says=says, env=env)
    fails("worker", "--redis-url", locked.url, "--model", str(model), code=USAGE, says=says, env=env)
    # Asked for, it gets past the check: the next problem shown is the (deliberately bad) device.
    args = ["--redis-url", locked.url, "--model", str(model), "--allow-random-weights", "--device", "tpu"]
    fails("worker", *args, code=USAGE, says="--device tpu: not a device name", env=env)


def test_engine_option_the_engine_does_not_take_is_an_error(locked, env):
    args = ["--redis-url", locked.url, "--engine", "reference", "--engine-option", "block_size=8"]
    fails("worker", *args, code=USAGE, says="the reference engine takes no --engine-option (got block_size)", env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(locked, env):
    says = "--device cuda: no CUDA device here"
    fails("worker", "--redis-url", locked.url, "--device", "cuda", code=USAGE, says=says, env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fp8_without_an_fp8_gpu(locked, env):
    says = "FP8 GEMMs (--dtype fp8) need the fast engine on an Ada or Hopper GPU, not the reference engine on cpu"
    fails("worker", "--redis-url", locked.url, "--dtype", "fp8", code=USAGE, says=says, env=env)
    says = "need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper) and the device is cpu: use --dtype"
    fails("worker", "--redis-url", locked.url, "--dtype", "fp8", "--engine", "fast", code=USAGE, says=says, env=env)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_caption_relays_its_workers_one_line_and_exit_code(tmp_path, image, env):
    """The workers fail on what only they can check; `caption` ends with their line and code."""
    out = tmp_path / "out.jsonl"
    line = fails("caption", image, "-o", str(out), "--device", "cuda", code=USAGE, says="no CUDA device here", env=env)
    assert "the workers exited before the work was done" in line
    log = Path(re.search(r"\(log: (\S+)\)", line)[1])
    assert log.is_relative_to(tmp_path / "cache" / "wicore" / "logs")
    assert "error: --device cuda: no CUDA device here" in log.read_text()


def test_enqueue_names_each_input_and_reports_each_it_could_not_enqueue(tmp_path, locked, env):
    images = write_images(tmp_path / "photos", 2)
    (tmp_path / "photos" / "notes.txt").write_text("not an image")
    run = wicore("enqueue", str(tmp_path / "photos"), "--redis-url", locked.url, env=env, check=False)
    assert run.returncode == 1 and PASSWORD not in run.stdout + run.stderr
    pairs = [line.split("\t") for line in run.stdout.splitlines()]
    assert [item for _, item in pairs] == [str(p) for p in images]
    warnings = run.stderr.strip().splitlines()
    assert warnings[1] == f"warning: not enqueued: {tmp_path / 'photos' / 'notes.txt'}: InputError: " + (
        f"{tmp_path / 'photos' / 'notes.txt'}: not an image file (supported: .bmp .gif .heic .heif .jpeg .jpg .png .tif .tiff .webp)"
    )
    assert warnings[0].startswith("warning: no live worker serves model democap (live workers serve: none)")
    connection = Redis.from_url(locked.url)
    for job_id, item in pairs:  # rq-dashboard shows which input a job is
        assert Job.fetch(job_id, connection=connection, serializer=JSONSerializer).description == f"caption {item}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting, says", [("MAX_IMAGE_BYTES", "over the 100-byte limit; raise the setting max_image_bytes"),
                      ("MAX_IMAGE_PIXELS", "over the limit of 100 pixels; raise the setting max_image_pixels")],
)  # fmt: skip
def test_size_limit_errors_name_the_setting_to_raise(setting, says, tmp_path, image, env):
    out = tmp_path / "out.jsonl"
    run = wicore("caption", image, "-o", str(out), env={**env, f"WICORE_{setting}": "100"}, check=False)
    assert run.returncode == 1, run.stderr
    [line] = [json.loads(line) for line in out.read_text().splitlines()]
    assert says in line["error"]  # bytes are refused as the job is made, pixels as the image decodes


@pytest.mark.parametrize(
    "module, verb, says",
    [
        (
            "matplotlib",
            ["bench", "mixed", "--preset", "tiny"],
            "matplotlib is not installed: pip install 'wicore[bench]'",
        ),
        ("fastapi", ["serve", "--port", str(free_port())], "fastapi is not installed: pip install 'wicore[serve]'"),
        ("torch", ["worker", "--burst"], "torch is not installed: pip install 'wicore[worker]'"),
        ("PIL", ["worker", "--burst"], "PIL (pillow) is not installed: pip install 'wicore[worker]'"),
    ],
)
def test_a_missing_extra_is_one_line_naming_what_to_install(module, verb, says, tmp_path, locked, env):
    scratch = tmp_path / "scratch"
    args = [*verb, *(["--workdir", str(scratch)] if verb[0] == "bench" else ["--redis-url", locked.url])]
    run = without(module, *args, env=env)
    assert run.returncode == USAGE and run.stderr.strip().splitlines() == [f"error: {says}"], run.stderr
    assert PASSWORD not in run.stdout + run.stderr
    assert not scratch.exists(), "a benchmark checks for its plots before it runs, not at its end"
    assert without(module, *verb, "--help", env=env).returncode == 0, "--help needs no extra"


def test_redact_hides_passwords_in_any_url():
    assert redact("at redis://:pw@h:6379/0 and rediss://user:p%40ss@h/1.") == (
        "at redis://:***@h:6379/0 and rediss://user:***@h/1."
    )
    assert redact("redis://h:6379/0 redis://user@h/0") == "redis://h:6379/0 redis://user@h/0"


@pytest.mark.slow
def test_a_model_that_does_not_fit_is_refused_in_one_line_before_loading(tmp_path, locked, env):
    model = tmp_path / "gemma3-27b"
    wicore("make-model", "gemma3-27b", str(model), env=env)
    args = ["--redis-url", locked.url, "--model", str(model), "--allow-random-weights", "--engine", "fast"]
    budget = ["--engine-option", f"memory_budget_bytes={32 * 2**30}"]  # a 32 GiB device, as the fit check sees it
    says = "the model does not fit: it needs 55.8 GiB (weights 51.1 GiB + KV 1.1 GiB"
    line = fails("worker", *args, "--dtype", "bfloat16", *budget, code=USAGE, says=says, env=env)
    assert "but 32.0 GiB is available (memory_budget_bytes); try --dtype fp8 (weights 26.9 GiB)" in line
    assert "a lower max_model_len (now 8192), a lower --batch-size (now 8), a GPU with more memory" in line
