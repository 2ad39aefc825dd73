"""Which worker processes `--gpus` and `--workers` ask for: parsing, pinning, names, caches."""

from __future__ import annotations

import pytest

from wicore.cli.common import engine_options
from wicore.cli.worker_specs import WorkerSpec, gpu_specs, parse_gpus, plan_workers, visible_device
from wicore.config import Settings, read_settings_file, write_settings_file
from wicore.defaults import gpu_decode_processes
from wicore.errors import ConfigError


@pytest.mark.parametrize(
    "text, count, expected",
    [("all", 4, [0, 1, 2, 3]), ("ALL", 1, [0]), ("0,1", 2, [0, 1]), ("1", 2, [1]), (" 2, 0 ", 3, [2, 0])],
)
def test_gpus_that_parse(text, count, expected):
    assert parse_gpus(text, count) == expected


@pytest.mark.parametrize(
    "text, count, says",
    [
        ("all", 0, "--gpus all: no CUDA device here; on CPU use --workers N"),
        ("0", 0, "--gpus 0: no CUDA device here; on CPU use --workers N"),
        ("2", 2, "--gpus 2: no GPU 2 here (2 visible: 0 to 1)"),
        ("0,1,5", 4, "--gpus 0,1,5: no GPU 5 here (4 visible: 0 to 3)"),
        ("0,1,0", 2, "--gpus 0,1,0: GPU 0 is named twice; name each GPU once"),
        ("-1", 2, "--gpus -1: '-1' is not a GPU index; give all, or indices such as 0,1"),
        ("0,", 2, "--gpus 0,: '' is not a GPU index"),
        ("", 2, "--gpus : '' is not a GPU index"),
        ("cuda:0", 2, "--gpus cuda:0: 'cuda:0' is not a GPU index"),
        ("0;1", 2, "--gpus 0;1: '0;1' is not a GPU index"),
        ("1.0", 2, "--gpus 1.0: '1.0' is not a GPU index"),
        ("٣", 4, "--gpus ٣: '٣' is not a GPU index"),  # a digit to str.isdigit, not an index
        ("all,0", 2, "--gpus all,0: 'all' is not a GPU index"),
    ],
)
def test_gpus_that_do_not_parse_say_what_to_give(text, count, says):
    with pytest.raises(ConfigError) as raised:
        parse_gpus(text, count)
    assert str(raised.value).startswith(says) and "\n" not in str(raised.value)


def test_a_child_sees_its_gpu_alone_through_the_parents_own_list():
    assert visible_device(1, None) == "1"
    assert visible_device(1, "") == "1"
    assert visible_device(1, "4,6") == "6", "the parent's cuda:1 is physical GPU 6"
    assert visible_device(0, "GPU-5d3c, GPU-77aa") == "GPU-5d3c"


def test_a_worker_per_gpu_is_pinned_to_it_by_its_environment():
    specs = gpu_specs("box", [1, 3], "4,5,6,7")
    assert [(s.name, s.slot, s.args, dict(s.env)) for s in specs] == [
        ("box-gpu1", "gpu1", ("--device", "cuda"), {"CUDA_VISIBLE_DEVICES": "5"}),
        ("box-gpu3", "gpu3", ("--device", "cuda"), {"CUDA_VISIBLE_DEVICES": "7"}),
    ]
    shared = gpu_specs("box", [0, 1], None, decode_processes=4)
    assert [s.args for s in shared] == [("--device", "cuda", "--decode-processes", "4")] * 2


@pytest.mark.parametrize(
    "cores, workers, processes", [(16, 1, 8), (16, 2, 4), (128, 8, 8), (64, 1, 8), (12, 4, 1), (4, 8, 1), (1, 1, 1)]
)
def test_gpu_workers_share_the_hosts_cores_for_decode_processes(cores, workers, processes):
    assert gpu_decode_processes(cores, workers) == processes


def test_workers_on_cpu_are_numbered_and_take_nothing_extra():
    specs = plan_workers("box", _settings(), gpus=None, workers=3)
    assert specs == [WorkerSpec("box-0", "0"), WorkerSpec("box-1", "1"), WorkerSpec("box-2", "2")]


def test_each_worker_gets_a_disk_cache_folder_of_its_own(tmp_path):
    settings = _settings(disk_cache_dir=str(tmp_path / "kv"), host_cache_bytes=2**20)
    specs = plan_workers("box", settings, gpus=None, workers=2)
    folders = [engine_options([spec.args[-1]])["disk_cache_dir"] for spec in specs]
    assert [spec.args[-2] for spec in specs] == ["--engine-option"] * 2
    assert folders == [str(tmp_path / "kv" / "0"), str(tmp_path / "kv" / "1")]
    child = read_settings_file(
        write_settings_file(settings, tmp_path), engine_options=engine_options([specs[1].args[-1]])
    )
    assert child.engine.disk_cache_dir == str(tmp_path / "kv" / "1") and child.engine.host_cache_bytes == 2**20


def test_gpus_and_workers_exclude_each_other_and_gpus_own_the_device():
    with pytest.raises(ConfigError, match="--gpus and --workers exclude each other"):
        plan_workers("box", _settings(), gpus="0", workers=2)
    with pytest.raises(ConfigError, match="--gpus pins each worker to its GPU; leave out --device cpu"):
        plan_workers("box", _settings(device="cpu"), gpus="all", workers=None)


def _settings(device: str = "auto", **engine) -> Settings:
    return Settings(device=device, engine={"name": "fast", **engine}) if engine else Settings(device=device)


def test_workers_spread_over_the_shards_one_shard_each():
    settings = Settings(redis_url="redis://a:6379/0,redis://b:6379/0")
    specs = plan_workers("w", settings, gpus=None, workers=3)
    assert [spec.args[spec.args.index("--redis-shard") + 1] for spec in specs] == ["0", "1", "0"]
    assert all("redis://" not in " ".join(spec.args) for spec in specs), "no URL (nor its password) in argv"
    assert all(
        "--redis-shard" not in spec.args
        for spec in plan_workers("w", Settings(redis_url="redis://a"), gpus=None, workers=2)
    )
