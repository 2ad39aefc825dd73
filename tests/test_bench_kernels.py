"""`wicore bench kernels` (core/bench/kernel_profile.py): the trace's sums on CPU, from events shaped
as torch.profiler writes them; the profile itself on a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import wicore
from wicore.bench.kernel_profile import KernelBench, category, summarize_trace


def kernel(name: str, ts: float, dur: float, stream: int, cat: str = "kernel") -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 0,
        "tid": stream,
        "ts": ts,
        "dur": dur,
        "args": {"stream": stream},
    }


def test_kernel_names_fall_into_their_kinds():
    kinds = {
        "_paged_attention_kernel": "paged attention (Triton)",
        "_pad_quantize_kernel": "FP8 attention's quantize passes",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_f8_knob_7": "attention (cuDNN / flash / SDPA)",
        "_add_layer_norm_quantize_kernel": "norm / GELU + FP8 quantize (ours)",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT": "GEMM",
        "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128": "GEMM",
        "triton_per_fused_add_mul_rsqrt_0": "fused elementwise / norms (Triton)",
        "Memcpy HtoD (Pinned -> Device)": "memcpy / memset",
        "void at::native::index_elementwise_kernel<128, 4>": "copy / index / cat",
        "void something_else<float>": "other",
    }
    assert {name: category(name) for name in kinds} == kinds


def test_the_trace_sums_by_kind_stream_and_name_and_its_busy_time_is_the_union():
    # stream 7 (main): decode attention and a GEMM back to back; stream 13 (side): a tower GEMM
    # overlapping both; a CPU op and a flow event are not device time
    events = [
        kernel("_paged_attention_kernel", 0, 300, 7),
        kernel("nvjet_tst_64x8", 300, 200, 7),
        kernel("nvjet_tst_256x128", 100, 600, 13),
        kernel("Memset (Device)", 1000, 100, 7, cat="gpu_memset"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
        {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 0, "id": 1},
    ]
    report = summarize_trace(events, images=2, wall_s=0.002)
    assert report["device_events"] == 4
    assert report["kernel_ms_per_image"] == pytest.approx(1.2 / 2)  # 300 + 200 + 600 + 100 us
    assert report["busy_ms_per_image"] == pytest.approx(0.8 / 2)  # [0, 700) and [1000, 1100)
    assert report["busy_fraction"] == pytest.approx(0.0008 / 0.002)
    gemm = report["by_kind"]["GEMM"]
    assert (gemm["ms"], gemm["count"], gemm["share"]) == (pytest.approx(0.8), 2, pytest.approx(0.8 / 1.2, abs=1e-4))
    assert list(report["by_kind"])[0] == "GEMM", "largest first"
    assert report["by_stream"]["13"]["ms"] == pytest.approx(0.6)
    assert report["by_stream"]["7"]["by_kind"]["paged attention (Triton)"]["ms"] == pytest.approx(0.3)
    assert [k["name"] for k in report["top_kernels"]][:2] == ["nvjet_tst_256x128", "_paged_attention_kernel"]
    assert report["top_kernels"][0]["streams"] == ["13"] and report["top_kernels"][0]["mean_us"] == 600


def test_a_real_trace_without_device_work_sums_to_nothing(tmp_path):
    """A trace torch.profiler exported (CPU activity: operators, no device events) is read, and
    none of it counts as device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("cat") == "cpu_op" for e in events)
    report = summarize_trace(events, images=1, wall_s=1.0)
    assert (report["device_events"], report["busy_ms_per_image"], report["by_kind"]) == (0, 0.0, {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_a_gpu_it_is_one_line_and_runs_nothing(tmp_path):
    run = wicore("bench", "kernels", "--workdir", str(tmp_path), check=False)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0 and "NVIDIA GPU" in run.stderr, run.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_engine_profiled_on_the_gpu_has_its_decode_attention_and_gemms(tmp_path, tiny_model_dir):
    from wicore.bench.kernel_profile import run_kernel_profile, write_kernel_profile

    bench = KernelBench(
        workdir=tmp_path, images=12, warmup_images=4, new_tokens=8, batch_size=8, model_dir=tiny_model_dir
    )
    report = run_kernel_profile(bench)
    assert report["device_events"] > 100 and {"paged attention (Triton)", "GEMM"} <= set(report["by_kind"])
    assert 0 < report["busy_ms_per_image"] <= report["kernel_ms_per_image"] + 1e-6
    assert report["busy_ms_per_image"] <= report["wall_ms_per_image"]
    assert len(report["by_stream"]) >= 2, "the tower on its side stream, text on the main one"
    json_path, png = write_kernel_profile(report, tmp_path / "out")
    assert json.loads(json_path.read_text())["images"] == 12 and png.stat().st_size > 0
