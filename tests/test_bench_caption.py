"""The caption benchmark's machinery on CPU (tiny model, reference engine as the engine under
test): the real run happens on the GPU machine; this keeps the code from rotting."""

from __future__ import annotations

import json

import pytest

from wicore.bench.caption_bench import CaptionBench, parity, run_caption_bench
from wicore.bench.report import gpu_slug, write_caption_report
from wicore.bench.roofline import Ceilings, image_work, roofline_images_per_s
from wicore.models.gemma3 import gemma3_4b_config

pytestmark = pytest.mark.slow


def test_roofline_matches_the_hand_count_for_gemma3_4b():
    work = image_work(gemma3_4b_config(), prompt_tokens=276, new_tokens=64)
    # the tower: 27 layers x 4,096 patches, ~3.4 TFLOP of GEMMs + ~2.1 of attention
    assert work.vision_flops / 1e12 == pytest.approx(5.45, abs=0.05)
    assert work.kv_bytes_per_token == 136 * 1024  # 136 KiB per token
    assert work.weight_bytes_per_step / 1e9 == pytest.approx(7.8, abs=0.2)  # ~8 GB per step
    images_per_s, bound = roofline_images_per_s(work, Ceilings(799e12, 4.25e12, 55e9), 64, 276, 64)
    assert images_per_s == pytest.approx(103, abs=2) and bound == "compute"  # 7.75 TFLOP an image at 799 TFLOP/s


def test_parity_counts_identical_sequences():
    report = parity({"a": [1, 2, 3], "b": [1, 5, 3]}, {"a": [1, 2, 3], "b": [1, 2, 3], "c": [9]})
    assert report == {"compared": 2, "identical": 1, "share": 0.5, "first_divergence_steps": [1]}


def test_gpu_slug():
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100" and gpu_slug("NVIDIA H200") == "h200"


def test_bench_runs_end_to_end_on_cpu(tmp_path, tiny_model_dir):
    bench = CaptionBench(
        workdir=tmp_path, images=6, new_tokens=4, batch_size=4, engine="reference", hf_batches=(2,),
        hf_images=4, hf_single_images=2, warmup_images=2, device="cpu", model_dir=tiny_model_dir,
    )  # fmt: skip
    report = run_caption_bench(bench, ceilings=Ceilings(1e12, 1e11, 1e10))
    assert report["error_count"] == 0 and report["images_per_s"] > 0
    assert set(report["hf_images_per_s"]) == {"1", "2"}
    # the reference engine in fp32 against HF generate on the same model: identical tokens
    assert report["parity_vs_hf_best_batch"]["share"] == 1.0
    paths = write_caption_report(report, tmp_path / "results")
    assert json.loads(paths[0].read_text())["gpu"] == "cpu" and paths[1].stat().st_size > 0
