"""The caption benchmark's machinery on CPU (tiny model, reference engine as the engine under
test): the real run happens on the GPU machine; this keeps the code from rotting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import wicore
from wicore.bench.caption_bench import CaptionBench, host_stacks, parity, run_caption_bench, worker_command
from wicore.bench.caption_scaling import (
    RUN_KEYS,
    gpu_count_check,
    run_scaling_bench,
    scaling,
    scaling_report,
    warmup_per_gpu,
)
from wicore.bench.report import gpu_slug, write_caption_report, write_scaling_report
from wicore.bench.roofline import Ceilings, image_work, roofline_images_per_s
from wicore.errors import ConfigError
from wicore.models.gemma3 import gemma3_4b_config, gemma3_config

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


def test_parity_gives_the_margin_where_each_differing_sequence_turned():
    margins = {"a": [3.0, 2.0, 1.0], "b": [4.0, 0.01, 5.0]}
    report = parity({"a": [1, 2, 3], "b": [1, 5, 3]}, {"a": [1, 2, 3], "b": [1, 2, 3]}, margins)
    assert report["margins_at_divergence"] == [0.01], "b turned at step 1, where HF's lead was 0.01"
    assert report["median_margin"] == 2.5, "the median of all six compared steps: (2 + 3) / 2"


def test_gpu_slug():
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100" and gpu_slug("NVIDIA H200") == "h200"


def test_bench_runs_end_to_end_on_cpu(tmp_path, tiny_model_dir, capsys):
    from wicore.bench.report import print_caption_report

    bench = CaptionBench(
        workdir=tmp_path, images=6, new_tokens=4, batch_size=4, engine="reference", hf_batches=(2,),
        hf_images=4, hf_repeats=2, hf_single_images=2, warmup_images=2, device="cpu", model_dir=tiny_model_dir,
    )  # fmt: skip
    report = run_caption_bench(bench, ceilings=Ceilings(1e12, 1e11, 1e10))
    assert report["error_count"] == 0 and report["images_per_s"] > 0
    assert set(report["hf_images_per_s"]) == {"1", "2"}
    passes = report["hf_images_per_s_passes"]["2"]
    assert len(passes) == 2 and report["hf_images_per_s"]["2"] == max(passes), "the peer's fastest pass counts"
    assert "--hf-repeats 2" in report["command"]
    # the reference engine in fp32 against HF generate on the same model: identical tokens
    assert report["parity_vs_hf_best_batch"]["share"] == 1.0
    assert report["parity_vs_hf_best_batch"]["margins_at_divergence"] == []
    assert report["parity_vs_hf_best_batch"]["median_margin"] > 0, "HF's top-1 leads its top-2 at a typical step"
    # HF's other batch size against its fastest (either may be fastest on a busy CPU)
    (other,) = report["hf_batches_vs_hf_best_batch"].values()
    assert other["share"] == 1.0
    start = report["start_timeline"]
    assert start["jobs"] == 6 and start["queued_s"][0] <= start["queued_s"][1] <= start["queued_s"][2]
    assert len(start["preprocess_s"]) == 3
    print_caption_report(report)
    assert "HF batch 1 vs HF best batch" in capsys.readouterr().out
    assert report["gpu_busy_fraction"] is None and report["gpu_busy_error"].startswith("no GPU"), "CPU: no figure"
    assert report["gpu_busy_by_second"] == [], "CPU: no profile either"
    paths = write_caption_report(report, tmp_path / "results")
    assert json.loads(paths[0].read_text())["gpu"] == "cpu" and paths[1].stat().st_size > 0


def test_bench_without_the_hf_peer_on_the_fast_engine_with_decode_processes(tmp_path, tiny_model_dir, capsys):
    """The A/B form (`--no-hf`): the product alone, here with the worker's images decoded and
    resized in its decode processes; every HF key is None and the report still prints."""
    from wicore.bench.report import print_caption_report

    bench = CaptionBench(
        workdir=tmp_path, images=6, new_tokens=4, batch_size=4, engine="fast", warmup_images=2, device="cpu",
        model_dir=tiny_model_dir, hf_peers=False, decode_processes=2, sample_stacks=True,
    )  # fmt: skip
    report = run_caption_bench(bench, ceilings=Ceilings(1e12, 1e11, 1e10))
    assert report["error_count"] == 0 and report["images_per_s"] > 0
    assert (
        report["command"]
        == "wicore bench caption --preset gemma3-4b --images 6 --no-hf --decode-processes 2 --sample-stacks"
    )
    stacks = report["host_stacks"]  # the loop thread sampled: the whole run, and the timed window's start apart
    assert stacks["samples"] > stacks["start"]["samples"] > 0 and "recent" not in stacks
    assert stacks["dips"] == [], "no GPU, no busy share a second"
    assert 0 < sum(share for _, share in stacks["start"]["innermost"]) <= 1.01, "shares of the window's samples"
    assert report["hf_images_per_s"] is None and report["parity_vs_hf_best_batch"] is None
    assert '"decode_processes": 2' in (tmp_path / "worker.log").read_text(), "the worker was told"
    queued, first_token = report["start_timeline"]["queued_s"], report["start_timeline"]["first_token_s"]
    assert 0 <= queued[0] <= first_token[0] and first_token[2] > 0, "the fast engine stamps each job's first token"
    print_caption_report(report)
    assert "not run (--no-hf)" in capsys.readouterr().out
    assert write_caption_report(report, tmp_path / "results")[1].stat().st_size > 0


@pytest.mark.parametrize(("variant", "per_prompt"), [("two-images", 2), ("text-only", 0)])
def test_the_variants_run_beside_hf_generate(tmp_path, tiny_model_dir, capsys, variant, per_prompt):
    """Two images a prompt and text only, on the fast engine and HF generate, the same prompts on
    both sides: prompts/s and images/s (or output tokens/s), token parity by prompt."""
    from wicore.bench.report import print_caption_report

    bench = CaptionBench(
        workdir=tmp_path, images=8, new_tokens=4, batch_size=4, engine="fast", hf_batches=(2,), hf_images=4,
        hf_repeats=1, hf_single_images=2, warmup_images=2, device="cpu", model_dir=tiny_model_dir, variant=variant,
    )  # fmt: skip
    report = run_caption_bench(bench, ceilings=Ceilings(1e12, 1e11, 1e10))
    assert report["error_count"] == 0 and report["variant"] == variant and report["images_per_prompt"] == per_prompt
    assert report["prompts_per_s"] > 0 and report["output_tokens_per_s"] == pytest.approx(4 * report["prompts_per_s"])
    assert report["images_per_s"] == pytest.approx(per_prompt * report["prompts_per_s"])
    assert report["engine_stats"]["images"] == (2 + 8 if per_prompt else 0), "the warm-up's and the timed images"
    assert report["roofline_images_per_s"] is None, "the roofline counts one image a prompt"
    assert set(report["hf_prompts_per_s"]) == {"1", "2"} and report["hf_best_output_tokens_per_s"] > 0
    assert report["speedup_vs_hf_best"] == report["prompts_per_s"] / report["hf_best_prompts_per_s"]
    parity = report["parity_vs_hf_batch1"]
    assert parity["compared"] == 2 and parity["share"] == 1.0, "the fast engine's tokens are HF's, prompt by prompt"
    assert "--dtype" not in report["command"] and f"--variant {variant} " in report["command"]
    print_caption_report(report)
    assert f"{variant} ({per_prompt})" in capsys.readouterr().out
    json_path, png = write_caption_report(report, tmp_path / "results")
    assert json_path.name == f"caption-gemma3-4b-{variant}-cpu.json" and png.stat().st_size > 0


def test_a_variant_is_named_and_runs_on_one_gpu():
    for args, says in ((("--variant", "three-images"), "choose one of one-image, two-images, text-only"),
                       (("--variant", "text-only", "--gpus", "2"), "runs on one GPU")):  # fmt: skip
        done = wicore("bench", "caption", *args, check=False)
        assert done.returncode == 2 and says in done.stderr, done.stderr


def test_the_seconds_the_gpu_idled_in_get_their_own_tables(tmp_path):
    """Past the start's window, each second under 0.95 busy gets the loop thread's samples taken in
    it, by place; the busy seconds and the start get none."""
    places = ["claim (loop.py:1)", "step (engine.py:2)"]
    # 10 samples a second from t=1000: the loop claims in second 3, steps in every other second
    samples = [[1000 + i / 10, 0 if 30 <= i < 40 else 1] for i in range(50)]
    path = tmp_path / "stacks.json"
    path.write_text(json.dumps({"samples": 50, "innermost": [], "recent": {"places": places, "samples": samples}}))
    report = host_stacks(path, 1000.0, [0.4, 0.5, 0.99, 0.6, None])
    assert report["start"]["samples"] == 21 and "recent" not in report
    assert report["dips"] == [
        {"second": 3, "busy": 0.6, "samples": 11, "innermost": [[places[0], 0.9091], [places[1], 0.0909]]}
    ]


def test_scaling_is_the_ratio_of_the_two_runs_and_its_share_of_perfect():
    assert scaling(190.0, 100.0, 2) == pytest.approx({"scaling": 1.9, "scaling_efficiency": 0.95})
    assert scaling(40.0, 40.0, 1) == {"scaling": 1.0, "scaling_efficiency": 1.0}
    assert math.isnan(scaling(10.0, 0.0, 2)["scaling"]), "no 1-GPU rate, no ratio"


def test_every_gpu_warms_up_with_at_least_a_full_claim():
    assert warmup_per_gpu(CaptionBench(workdir=Path("/x"), warmup_images=64, batch_size=384)) == 384
    assert warmup_per_gpu(CaptionBench(workdir=Path("/x"), warmup_images=64, batch_size=8)) == 64


def test_the_benchmark_needs_the_gpus_it_names():
    gpu_count_check(2, 2)
    with pytest.raises(ConfigError, match="^--gpus 2: the benchmark needs 2 GPUs and 1 are visible here$"):
        gpu_count_check(2, 1)


def test_worker_command_plain_per_gpu_and_on_cpu():
    def extra(device: str, gpus: int) -> list[str]:
        command = worker_command(
            CaptionBench(workdir=Path("/x"), device=device), "redis://r", Path("/m"), Path("/i"), gpus
        )
        assert command[1:4] == ["-m", "wicore.cli.main", "worker"]
        return command[command.index("--allow-random-weights") + 1 :]

    assert extra("cuda", 0) == [] and extra("cpu", 0) == []
    assert extra("cuda", 1) == ["--gpus", "0"] and extra("cuda", 4) == ["--gpus", "0,1,2,3"]
    assert extra("cpu", 2) == ["--workers", "2"], "the same supervisor, CPU workers"


def product_run(images_per_s: float) -> dict:
    """What `run_product` returns, at this rate."""
    return {**dict.fromkeys(RUN_KEYS, 0), "images_per_s": images_per_s, "errors": [], "engine_stats_by_worker": {}}


def test_scaling_report_files_have_the_keys_and_a_plot(tmp_path):
    bench = CaptionBench(workdir=tmp_path, images=512, gpus=2)
    report = scaling_report(bench, product_run(40.0), product_run(76.0), "NVIDIA H100 80GB HBM3")
    json_path, png = write_scaling_report(report, tmp_path / "results")
    assert json_path.name == "caption-gemma3-4b-h100-x2.json" and png.name == "caption-gemma3-4b-h100-x2.png"
    saved = json.loads(json_path.read_text())
    assert {k: saved[k] for k in ("gpus", "images_per_s", "images_per_s_1gpu", "scaling")} == {
        "gpus": 2, "images_per_s": 76.0, "images_per_s_1gpu": 40.0, "scaling": 1.9,
    }  # fmt: skip
    assert saved["command"] == "wicore bench caption --preset gemma3-4b --gpus 2 --images 512"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_fp8_scaling_report_is_named_and_reruns_as_fp8(tmp_path):
    options = {"gemm_dtype": "fp8", "vision_attention_dtype": "fp8"}
    bench = CaptionBench(workdir=tmp_path, images=2048, gpus=2, engine_options=options)
    report = scaling_report(bench, product_run(75.0), product_run(149.0), "NVIDIA H100 80GB HBM3")
    json_path, png = write_scaling_report(report, tmp_path / "results")
    assert (json_path.name, png.name) == ("caption-gemma3-4b-fp8-h100-x2.json", "caption-gemma3-4b-fp8-h100-x2.png")
    assert report["gemm_dtype"] == "fp8" and report["engine_options"] == options, "both sides ran FP8 GEMMs"
    assert report["command"] == (
        "wicore bench caption --preset gemma3-4b --gpus 2 --images 2048 --dtype fp8"
        " --engine-option vision_attention_dtype=fp8"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_gpus_flag_is_checked_before_anything_runs(tmp_path):
    negative = wicore("bench", "caption", "--gpus", "-1", "--workdir", str(tmp_path), check=False)
    assert negative.returncode == 2 and negative.stderr.startswith("error: Invalid value for '--gpus': Input should")
    missing = wicore("bench", "caption", "--gpus", "2", "--workdir", str(tmp_path), check=False)
    assert (missing.returncode, missing.stderr) == (
        2,
        "error: --gpus 2: the benchmark needs 2 GPUs and 0 are visible here\n",
    )
    assert not any(tmp_path.iterdir()), "nothing made, nothing run"


def test_scaling_bench_runs_end_to_end_on_cpu(tmp_path, tiny_model_dir):
    """On CPU the N-GPU side is `wicore worker --workers N`: the same supervisor, the same path."""
    bench = CaptionBench(workdir=tmp_path, images=4, new_tokens=4, batch_size=2, engine="reference",
                         warmup_images=2, device="cpu", model_dir=tiny_model_dir, gpus=2)  # fmt: skip
    report = run_scaling_bench(bench)
    assert report["run_1gpu"]["error_count"] == report["run_ngpu"]["error_count"] == 0
    assert report["run_1gpu"]["images"] == 4 and report["run_ngpu"]["images"] == 8, "the same work per worker"
    assert report["images_per_s"] > 0 and report["scaling"] == report["images_per_s"] / report["images_per_s_1gpu"]
    workers = report["engine_stats_by_worker"]
    assert sorted(name[-2:] for name in workers) == ["-0", "-1"], "one supervised worker per slot"
    assert all(stats["jobs_done"] > 0 for stats in workers.values()), "both served"
    paths = write_scaling_report(report, tmp_path / "results")
    assert [p.name for p in paths] == ["caption-gemma3-4b-cpu-x2.json", "caption-gemma3-4b-cpu-x2.png"]


def test_roofline_of_the_27b():
    work = image_work(gemma3_config("gemma3-27b"), prompt_tokens=276, new_tokens=64)
    assert work.kv_bytes_per_token == 62 * 2 * 16 * 128 * 2  # 62 layers x K and V x 16 heads x 128 x bf16
    assert work.weight_bytes_per_step / 1e9 == pytest.approx(54.0, abs=0.3)  # 25.6 B in layers + 1.4 B lm_head
    assert work.vision_flops == image_work(gemma3_4b_config(), 276, 64).vision_flops  # the same SigLIP tower


def test_a_presets_report_is_named_and_reruns_as_that_preset(tmp_path):
    bench = CaptionBench(workdir=tmp_path, preset="gemma3-27b", images=512, gpus=2)
    report = scaling_report(bench, product_run(10.0), product_run(19.0), "NVIDIA H100 80GB HBM3")
    json_path, _ = write_scaling_report(report, tmp_path / "results")
    assert json_path.name == "caption-gemma3-27b-h100-x2.json"
    assert report["command"] == "wicore bench caption --preset gemma3-27b --gpus 2 --images 512"


def test_an_unknown_preset_is_refused_before_anything_runs(tmp_path):
    run = wicore("bench", "caption", "--preset", "gemma3-70b", "--workdir", str(tmp_path), check=False)
    assert (run.returncode, run.stderr) == (
        2,
        "error: unknown preset 'gemma3-70b'; choose one of gemma3-4b, gemma3-12b, gemma3-27b\n",
    )
    assert not any(tmp_path.iterdir()), "nothing made, nothing run"


def test_bench_with_sampling_parameters_runs_both_sides_on_the_same_images(tmp_path, tiny_model_dir, capsys):
    """`--sampling JSON`: the product without and with the parameters on every job, one run."""
    from wicore.bench.caption_sampling import run_sampling_bench
    from wicore.bench.report import print_sampling_report, write_sampling_report
    from wicore.cli.bench import sampling_params

    sampling = sampling_params(
        '{"repetition_penalty": 1.1, "presence_penalty": 0.5, "logprobs": true, "top_logprobs": 2}'
    )
    bench = CaptionBench(
        workdir=tmp_path, images=6, new_tokens=4, batch_size=4, engine="fast", warmup_images=2, device="cpu",
        model_dir=tiny_model_dir, hf_peers=False, decode_processes=0,
    )  # fmt: skip
    report = run_sampling_bench(bench, sampling, ceilings=Ceilings(1e12, 1e11, 1e10))
    variant = report["sampling"]
    assert report["error_count"] == variant["error_count"] == 0 and variant["images_per_s_ratio"] > 0
    assert variant["params"] == sampling and report["command"].endswith(
        """--sampling '{"logprobs": true, "presence_penalty": 0.5, "repetition_penalty": 1.1, "top_logprobs": 2}'"""
    )
    print_sampling_report(report)
    assert "images/s ratio" in capsys.readouterr().out
    assert write_sampling_report(report, tmp_path / "results")[0].name.startswith("caption-gemma3-4b-sampling-")
