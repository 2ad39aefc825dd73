"""`wicore bench stream` end to end on the tiny preset with a few requests: both sides answer,
the first streamed token comes before the stream's end, and the report and plot are written."""

from __future__ import annotations

import json

import pytest

from tests.helpers import wicore

pytestmark = pytest.mark.slow


def test_bench_stream_reports_the_first_token_beside_the_whole_answer(tmp_path):
    done = wicore(
        "bench", "stream", "--preset", "tiny", "--requests", "6", "--concurrency", "3", "--new-tokens", "12",
        "--workdir", str(tmp_path / "work"), "--out", str(tmp_path), "--json", timeout=600,
    )  # fmt: skip
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["command"].startswith("wicore bench stream --preset tiny --requests 6")
    assert 0 < report["streamed_ttft_p50_s"] <= report["streamed_total_p50_s"]
    assert 0 < report["whole_total_p50_s"] <= report["whole_total_p99_s"]
    assert report["streamed_chunks_mean"] > 2  # tokens arrive step by step, not at the end
    assert json.loads((tmp_path / "stream-tiny-cpu.json").read_text()) == report
    assert (tmp_path / "stream-tiny-cpu.png").stat().st_size > 1000
