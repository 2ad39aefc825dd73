"""The FP8 caption benchmark's machinery on CPU (`wicore.bench.caption_fp8`): the real runs are on
the GPU machine. Here the bf16 side is a real run of the benchmark (tiny model, reference engine),
the FP8 side that run's product with some tokens changed (no CPU engine serves FP8 through a
worker), and the demo captioner runs through the fast engine's FP8 path on the CPU."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.helpers import wicore
from wicore.bench.caption_bench import CaptionBench, caption_report, caption_runs
from wicore.bench.caption_fp8 import bf16_variant, democap_accuracy, fp8_report, fp8_variant, token_agreement
from wicore.bench.report import print_fp8_report, write_fp8_report
from wicore.bench.roofline import Ceilings

pytestmark = pytest.mark.slow


def test_token_agreement_counts_sequences_and_positions():
    bf16 = {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4], "c": [5, 6, 7, 8], "only-bf16": [9]}
    fp8 = {"a": [1, 2, 3, 4], "b": [1, 2, 9, 9], "c": [5, 0, 7, 8]}
    assert token_agreement(fp8, bf16) == {
        "compared": 3,
        "sequences_identical": 1,
        "sequences_identical_share": pytest.approx(1 / 3),
        "mean_token_agreement": pytest.approx((1 + 0.5 + 0.75) / 3),
        "median_first_divergence_step": 1.5,
    }


def test_the_report_has_the_bf16_keys_both_modes_and_a_plot(tmp_path, tiny_model_dir, capsys):
    bench = CaptionBench(
        workdir=tmp_path, images=6, new_tokens=4, batch_size=4, engine="reference", hf_batches=(2,),
        hf_images=4, hf_single_images=2, warmup_images=2, device="cpu", model_dir=tiny_model_dir,
    )  # fmt: skip
    runs = caption_runs(bench, ceilings=Ceilings(1e12, 1e11, 1e10))
    changed = dict(runs.product["tokens"])
    first = sorted(changed)[0]
    changed[first] = changed[first][:2] + [0, 0]
    twice = {key: 2 * runs.product[key] for key in ("images_per_s", "prompts_per_s")}
    product = {**runs.product, "tokens": changed, **twice}
    democap = democap_accuracy("cpu", images=8, fp8_anywhere=True)
    assert democap["fp8_linears"] == 24 and democap["bf16_linears"] == 0 and democap["fp8_skipped"] == []
    assert democap["fp8_attention_layers"] == 0
    assert democap["fp8"] >= democap["bf16"] - 0.25 > 0.5

    report = fp8_report(bench, runs, replace(runs, product=product), democap)
    assert set(caption_report(bench, runs)) <= set(report)
    assert report["engine_options"] == {"gemm_dtype": "fp8"} and "--dtype fp8" in report["command"]
    assert report["fp8_speedup_vs_bf16"] == pytest.approx(2.0)
    assert report["roofline_fraction"] == pytest.approx(2 * report["bf16"]["roofline_fraction"])
    agreement = report["token_agreement_vs_bf16"]
    assert (agreement["compared"], agreement["sequences_identical"]) == (6, 5)
    assert agreement["median_first_divergence_step"] == 2.0

    json_path, png = write_fp8_report(report, tmp_path / "results")
    assert json_path.name == "caption-gemma3-4b-fp8-cpu.json" and png.stat().st_size > 0
    assert json.loads(json_path.read_text())["democap_accuracy"]["images"] == 8
    print_fp8_report(report)
    assert "demo captioner exact match" in capsys.readouterr().out

    # --no-hf (the A/B runs): no speedups, the same report, plot and table
    alone = fp8_report(
        replace(bench, hf_peers=False), replace(runs, peers=None), replace(runs, product=product, peers=None), democap
    )
    assert alone["speedup_vs_hf_best"] is None and alone["bf16"]["speedup_vs_hf_best"] is None
    json_path, png = write_fp8_report(alone, tmp_path / "alone")
    assert png.stat().st_size > 0 and "--no-hf" in json.loads(json_path.read_text())["command"]
    print_fp8_report(alone)
    assert "n/a (--no-hf)" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_dtype_flag_is_checked_before_anything_runs(tmp_path):
    run = wicore("bench", "caption", "--dtype", "float16", "--workdir", str(tmp_path), check=False)
    assert run.returncode == 2 and run.stderr.startswith("error: --dtype"), run.stderr
    # --dtype fp8 with --gpus is the scaling run in FP8: what it checks first is the GPU count
    run = wicore("bench", "caption", "--dtype", "fp8", "--gpus", "2", "--workdir", str(tmp_path), check=False)
    assert run.returncode == 2 and run.stderr.startswith("error: --gpus 2: the benchmark needs 2 GPUs"), run.stderr
    assert not any(tmp_path.iterdir()), "nothing made, nothing run"


def test_the_bf16_run_leaves_out_the_fp8_modes_kv_pages_and_the_demo_captioner_takes_them(tmp_path):
    """An FP8 KV cache asked for is the FP8 run's alone: the bf16 run stays the model dtype's
    baseline, and the FP8 leg's demo captioner reads FP8 pages too."""
    options = {"kv_cache_dtype": "fp8", "vision_compile_mode": "default"}
    bench = CaptionBench(workdir=tmp_path, engine_options=options)
    assert bf16_variant(bench).engine_options == {"vision_compile_mode": "default"}
    assert fp8_variant(bench).engine_options == {**options, "gemm_dtype": "fp8"}
    democap = democap_accuracy("cpu", images=8, fp8_anywhere=True, kv_cache_dtype="fp8")
    assert (democap["bf16_kv_dtype"], democap["fp8_kv_dtype"]) == ("bfloat16", "float8_e4m3fn")
    assert democap["fp8"] >= democap["bf16"] - 0.25 > 0.5


def test_the_demo_captioner_runs_the_fp8_legs_attention():
    """With vision_attention_dtype=fp8 the FP8 leg's demo captioner runs its tower's attention in
    FP8 too (on the CPU through its definition) and the report names it."""
    democap = democap_accuracy("cpu", images=8, fp8_anywhere=True, attention="fp8")
    assert democap["fp8_vision_attention"] == "fp8" and democap["fp8_linears"] == 24
    assert (democap["fp8_attention_layers"], democap["bf16_attention_layers"]) == (4, 0)  # its 4 vision layers
    assert democap["fp8"] >= democap["bf16"] - 0.25 > 0.5
