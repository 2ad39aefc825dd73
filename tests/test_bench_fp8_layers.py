"""`wicore bench fp8-layers` on CPU at the demo captioner's shapes (the real run is on the GPU):
every figure is there and the ratios are bf16 time over FP8 time."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from tests.helpers import wicore
from wicore.bench.fp8_layers import Shapes, gemm_shapes, print_fp8_layers, run_fp8_layers, write_fp8_layers
from wicore.models import DEMOCAP_DIR
from wicore.models.gemma3 import gemma3_4b_config


def test_the_gemms_are_the_ones_fp8_quantizes_at_the_4b_shapes():
    config = gemma3_4b_config()
    shapes = {name: (m, n, k) for name, m, n, k in gemm_shapes(config.vision_config, config.text_config, Shapes())}
    assert shapes["vision qkv"] == (65_536, 3 * 1152, 1152) and shapes["vision fc2"] == (65_536, 1152, 4304)
    assert shapes["prefill qkv"] == (18_048, 4096, 2560) and shapes["decode down"] == (384, 2560, 10_240)
    assert len(shapes) == 12


def test_probe_runs_on_cpu_and_reports_every_figure(tmp_path, capsys):
    config = AutoConfig.from_pretrained(DEMOCAP_DIR)
    report = run_fp8_layers(config, "cpu", Shapes(images=2, prefill_rows=32, decode_rows=4), compile=False, repeats=3)
    assert len(report["gemms"]) == 12 and all(row["fp8_with_quantize_ms"] > 0 for row in report["gemms"])
    vision, decoder = report["vision_layer"], report["decoder_dense"]
    assert vision["rows"] == 2 * 64
    assert vision["fp8_eager_speedup"] == pytest.approx(vision["bf16_eager_ms"] / vision["fp8_eager_ms"], rel=0.05)
    assert {"fp8_tensorwise_eager_32_rows_speedup", "fp8_eager_4_rows_ms"} <= set(decoder)
    path = write_fp8_layers(report, tmp_path)
    assert path.name == "fp8-layers-cpu.json" and json.loads(path.read_text())["shapes"]["images"] == 2
    print_fp8_layers(report)
    assert "decoder dense" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_the_probe_needs_an_fp8_gpu():
    run = wicore("bench", "fp8-layers", "--no-compile", check=False)
    assert (run.returncode, run.stderr.count("\n")) == (2, 1) and "compute capability 8.9+" in run.stderr
