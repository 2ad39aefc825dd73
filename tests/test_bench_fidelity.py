"""`wicore bench fidelity` on CPU, small: the mechanism (configs, rounds, scoring, report), the
float32 margins it computes where tokens differ, and token-identical cached paths in float32."""

from __future__ import annotations

import json

import pytest

from wicore.bench.fidelity import (
    FidelityBench,
    ReferenceLogits,
    make_samples,
    run_config,
    run_fidelity_bench,
    summary,
    write_fidelity_report,
)
from wicore.models import DEMOCAP_DIR


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    bench = FidelityBench(
        tmp_path_factory.mktemp("fidelity"), images=4, device="cpu", dtype="float32", batch_size=4,
        small_pool_pages=40, host_cache_bytes=2**20,
    )  # fmt: skip
    return run_fidelity_bench(bench)


def test_cached_paths_give_the_tokens_of_caching_off_in_float32(report):
    assert report["model"] == "democap" and report["gpu"] == "cpu" and report["dtype"] == "float32"
    assert [c["name"] for c in report["configs"]] == ["off", "gpu tiers", "small gpu pool + cpu tier"]
    for config in report["configs"]:
        assert config["sequences"] == 16 and config["same_tokens"] == 16 and config["differing"] == []
        assert config["same_tokens_by_round"] == {0: 4, 1: 4, 2: 4, 3: 4}
        assert set(config["exact_match_by_round"]) == {0, 2}  # the caption prompt's rounds
    off, gpu, small = (c["stats"] for c in report["configs"])
    assert off["cached_prompt_tokens"] == 0 and "gpu" not in off["cache"]
    assert gpu["cache"]["gpu"]["hits"] > 0 and gpu["images_encoded"] == 4  # follow-ups reuse the image's blocks
    assert small["cache"]["host"]["hits"] > 0  # ... and come back from the CPU tier when the pool is small


def test_the_demo_captioner_is_right_through_every_config(report):
    # Four images of seed 1000: the shipped checkpoint captions them right (0.974 over 1,000).
    for config in report["configs"]:
        assert config["exact_match_by_round"] == {0: 1.0, 2: 1.0}


def test_report_file_and_summary(report, tmp_path):
    path = write_fidelity_report(report, tmp_path, tag="fp32")
    assert path.name == "fidelity-democap-cpu-fp32.json"
    assert json.loads(path.read_text())["configs"][1]["same_tokens"] == 16
    lines = summary(report)
    assert lines[1].startswith("gpu tiers: same tokens as off 16/16; exact match round 0: 1.000")


def test_margin_at_a_position_past_the_prompt(tmp_path):
    # The float32 reference continues the prompt with the tokens both runs agree on: at greedy's
    # own choice, caching off's token is the top-1 and the other token's logit is lower.
    bench = FidelityBench(tmp_path, images=1, device="cpu", dtype="float32", batch_size=1)
    samples = make_samples(bench)[:1]
    out, _ = run_config(DEMOCAP_DIR, bench, False, {}, samples)
    ids = out[samples[0].request.id].token_ids
    other = (ids[2] + 1) % 100
    result = ReferenceLogits(DEMOCAP_DIR, "cpu").margin(samples[0].request, 2, ids[:3] + [other])
    assert result["fp32_prefers"] == "off" and result["margin_fp32"] >= 0
    assert result["logit_off_fp32"] - result["logit_fp32"] >= result["margin_fp32"]
    assert (result["off_token"], result["token"]) == (ids[2], other)
