"""The mixed benchmark's machinery on CPU (tiny model, fast engine): the real run is the GPU's;
this runs the mechanism end to end with small counts and checks what it writes."""

from __future__ import annotations

import json

import pytest

from wicore.bench.mixed_bench import MixedBench, preset_bench, run_mixed_bench, twin_images, write_mixed_report
from wicore.errors import ConfigError
from wicore.ops.image_decode import decode_image

pytestmark = pytest.mark.slow

KEYS = {"interactive_p50_s", "interactive_p99_s", "idle_p50_s", "idle_p99_s", "p99_ratio",
        "bulk_images_per_s_mixed", "bulk_images_per_s_alone", "saturated", "command"}  # fmt: skip


def test_presets_and_overrides(tmp_path):
    tiny = preset_bench("tiny", tmp_path, rate=4.0, batch_size=None, engine_options={"vision_batch_size": 4})
    assert (tiny.device, tiny.batch_size, tiny.rate) == ("cpu", 16, 4.0), "None keeps the preset's value"
    assert tiny.engine_options == {"torch_threads": 1, "vision_batch_size": 4}
    gpu = preset_bench("gemma3-4b", tmp_path)
    assert (gpu.device, gpu.batch_size, gpu.bulk_images) == ("cuda", 384, 6144)
    assert gpu.command == "wicore bench mixed --preset gemma3-4b --bulk-images 6144 --interactive 120 --rate 1"
    with pytest.raises(ConfigError, match="^unknown preset 'gemma3-12b'; choose one of gemma3-4b, tiny$"):
        preset_bench("gemma3-12b", tmp_path)


def test_twin_images_decode_to_the_same_pixels_under_a_new_hash(tmp_path):
    from wicore.bench.bench_images import make_images

    originals = make_images(tmp_path, 2, processes=1)  # one PNG, one JPEG
    for original, twin in zip(originals, twin_images(originals)):
        assert twin.read_bytes() != original.read_bytes()
        assert decode_image(twin.read_bytes()).tobytes() == decode_image(original.read_bytes()).tobytes()


def test_bench_runs_end_to_end_on_cpu(tmp_path, tiny_model_dir):
    bench = MixedBench(workdir=tmp_path, preset="tiny", bulk_images=40, interactive=3, rate=4.0, lead_s=0.5,
                       new_tokens=4, batch_size=4, high_lane_slots=1, warmup_images=2, device="cpu",
                       model_dir=tiny_model_dir)  # fmt: skip
    report = run_mixed_bench(bench)
    assert report["error_count"] == 0 and report["interactive_jobs"] == 3
    assert len(report["idle_latencies_s"]) == len(report["interactive_latencies_s"]) == 3
    assert report["p99_ratio"] == report["interactive_p99_s"] / report["idle_p99_s"] > 0
    assert report["bulk_done"] > 0 and report["bulk_images_per_s_alone"] is not None and report["high_lane_slots"] == 1
    json_path, png = write_mixed_report(report, tmp_path / "results")
    assert json_path.name == "mixed-cpu.json" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(json.loads(json_path.read_text())) >= KEYS
