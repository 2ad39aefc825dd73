"""`wicore bench caption --guided-schema FILE` on CPU (tiny model): the same images free and
with the schema on every job in one run, both rates and their ratio; a bad schema file is a
one-line exit 2 before anything starts."""

from __future__ import annotations

import json

import pytest

from tests.helpers import wicore
from wicore.bench.caption_bench import CaptionBench
from wicore.bench.caption_guided import load_schema, run_guided_bench
from wicore.bench.guided_bench import SCHEMA

pytestmark = pytest.mark.slow


def test_free_and_constrained_run_on_the_same_images(tmp_path, tiny_model_dir):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    bench = CaptionBench(
        workdir=tmp_path, images=4, new_tokens=48, batch_size=4, engine="fast", warmup_images=2, device="cpu",
        model_dir=tiny_model_dir, hf_peers=False,
    )  # fmt: skip
    report = run_guided_bench(bench, load_schema(schema))
    free, constrained = report["free"], report["constrained"]
    assert free["error_count"] == constrained["error_count"] == 0 and free["images"] == constrained["images"] == 4
    assert report["images_per_s_ratio"] == constrained["images_per_s"] / free["images_per_s"]
    assert report["guided"] == {"json_schema": SCHEMA}
    assert report["constrained_engine_stats"]["jobs_done"] >= 6, "warm-up and timed jobs, all guided"
    host = report["guided_host"]
    assert host["steps"] > 0 and host["wait_ms_per_step"] >= 0 and host["mask_ms_per_step"] > 0


def test_a_bad_schema_file_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "strng"}))
    done = wicore("bench", "caption", "--guided-schema", str(bad), "--workdir", str(tmp_path), check=False)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and 'Unsupported type "strng"' in done.stderr
