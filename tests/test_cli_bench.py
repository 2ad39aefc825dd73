"""`wicore bench caption`'s dispatch (wicore.cli.bench): the flags pick one mode, each mode's
files land under --out with their names, and its summary comes in its place beside them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import wicore
from wicore.bench.caption_bench import CaptionBench
from wicore.bench.guided_bench import SCHEMA
from wicore.cli.bench import CAPTION_MODES, CaptionPlan, caption_plan, publish_caption
from wicore.errors import ConfigError


def plan_of(tmp_path: Path, dtype="bfloat16", guided=None, sampling=None, window=False, gpus=0) -> CaptionPlan:
    bench = CaptionBench(workdir=tmp_path, gpus=gpus, engine_options={"kv_cache_dtype": "fp8"})
    return caption_plan(bench, tmp_path / "out", dtype, guided, sampling, window)


def test_the_flags_pick_one_mode_in_their_order(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    sampling = '{"repetition_penalty": 1.1}'
    assert plan_of(tmp_path).mode == "vs-hf" and plan_of(tmp_path, "fp8").mode == "fp8"
    assert plan_of(tmp_path, gpus=2).mode == "scaling"
    assert plan_of(tmp_path, window=True, gpus=2).mode == "window"
    assert plan_of(tmp_path, sampling=sampling, window=True).sampling == {"repetition_penalty": 1.1}
    guided = plan_of(tmp_path, "fp8", guided=schema, sampling="not JSON: --guided-schema comes first", gpus=2)
    assert guided.mode == "guided" and guided.guided == {"json_schema": SCHEMA}
    assert set(CAPTION_MODES) == {"vs-hf", "fp8", "scaling", "sampling", "guided", "window"}


def test_fp8_reaches_the_guided_and_scaling_benches_and_the_fp8_mode_makes_its_own(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    fp8 = {"kv_cache_dtype": "fp8", "gemm_dtype": "fp8"}
    assert plan_of(tmp_path, "fp8", guided=schema).bench.engine_options == fp8
    assert plan_of(tmp_path, "fp8", gpus=2).bench.engine_options == fp8
    assert plan_of(tmp_path, "fp8").bench.engine_options == {"kv_cache_dtype": "fp8"}, "bf16 and FP8 from one bench"
    assert plan_of(tmp_path, window=True).bench.engine_options == {"kv_cache_dtype": "fp8"}


def test_sampling_runs_on_its_own(tmp_path):
    for dtype, gpus in (("fp8", 0), ("bfloat16", 2)):
        with pytest.raises(ConfigError, match="^--sampling runs on its own: without --gpus and --dtype fp8$"):
            plan_of(tmp_path, dtype, sampling='{"seed": 1}', gpus=gpus)


def guided_report(gemm_dtype: str | None) -> dict:
    side = {"images_per_s": 2.0, "output_tokens_per_s": 100.0}
    options = {"gemm_dtype": gemm_dtype} if gemm_dtype else {}
    return {"gpu": "NVIDIA H100 80GB HBM3", "preset": "gemma3-4b", "engine_options": options, "free": side,
            "constrained": {**side, "images_per_s": 1.5}, "images_per_s_ratio": 0.75,
            "output_tokens_per_s_ratio": 0.8, "guided_host": {"steps": 4}}  # fmt: skip


@pytest.mark.parametrize(("gemm_dtype", "name"), [(None, "guided-h100"), ("fp8", "guided-fp8-h100")])
def test_the_guided_mode_writes_its_json_then_prints_its_ratio(tmp_path, capsys, gemm_dtype, name):
    plan = CaptionPlan("guided", CaptionBench(workdir=tmp_path), tmp_path / "out")
    report = guided_report(gemm_dtype)
    publish_caption(CAPTION_MODES["guided"], report, plan)
    path = tmp_path / "out" / f"caption-gemma3-4b-{name}.json"
    assert json.loads(path.read_text()) == report
    assert capsys.readouterr().err == (
        f"wrote {path}\nfree 2.00 images/s, constrained 1.50 images/s: ratio 0.750 (output tokens/s ratio 0.800)\n"
        'guided host per step (ms): {"steps": 4}\n'
    )


def test_the_window_mode_prints_its_sides_then_writes_its_json(tmp_path, capsys):
    plan = CaptionPlan("window", CaptionBench(workdir=tmp_path, preset="gemma3-12b", device="cpu"), tmp_path / "out")
    side = {"redis_peak_over_start_bytes": 3 * 2**20, "images_per_s": 4.5, "blobs_left": 0}
    report = {"photos": 8, "photo_bytes_total": 8 * 2**20, **{f"window_{key}": value for key, value in side.items()}}
    publish_caption(CAPTION_MODES["window"], {**report, "window_wall_s": 1.0}, plan)
    path = tmp_path / "out" / "caption-window-gemma3-12b-cpu.json"
    assert json.loads(path.read_text())["window_images_per_s"] == 4.5
    assert capsys.readouterr().err == (
        f"8 photos, 8 MiB\nwindow: Redis peak 3.0 MiB over start, 4.5 images/s, 0 blobs left\nwrote {path}\n"
    )


@pytest.mark.slow
def test_the_window_mode_runs_through_the_table_on_cpu(tmp_path, tiny_model_dir, capsys):
    """`wicore caption --redis-url` on the tiny model, window at its default and unbounded: the
    table's run, then its sides, then its JSON."""
    bench = CaptionBench(
        workdir=tmp_path, images=4, new_tokens=4, batch_size=4, engine="fast", device="cpu", model_dir=tiny_model_dir
    )
    plan = caption_plan(bench, tmp_path / "out", "bfloat16", None, None, True)
    mode = CAPTION_MODES[plan.mode]
    report = mode.run(plan)
    assert report["window_lines"] == report["unbounded_lines"] == 4 and report["window_blobs_left"] == 0
    assert report["caption_args"][:4] == ["--model", str(tiny_model_dir), "--model-id", "gemma3-4b"]
    assert report["command"] == "wicore bench caption --preset gemma3-4b --images 4 --compare-window"
    publish_caption(mode, report, plan)
    path = tmp_path / "out" / "caption-window-gemma3-4b-cpu.json"
    assert json.loads(path.read_text()) == report
    assert capsys.readouterr().err.splitlines()[-1] == f"wrote {path}"


@pytest.mark.parametrize("sizes", ["a,b", "8,,32", "0,8"])
def test_bad_hf_batch_sizes_are_one_line_exit_2(tmp_path, sizes):
    done = wicore("bench", "caption", "--hf-batches", sizes, "--workdir", str(tmp_path), check=False)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "--hf-batches" in done.stderr
    assert not (tmp_path / "images").exists(), "refused before anything runs"
