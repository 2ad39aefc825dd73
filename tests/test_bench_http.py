"""`wicore bench http` end to end on a few jobs: both sides submit the same jobs, every job
finishes on a null-engine worker, and the report and plot are written."""

from __future__ import annotations

import json

import pytest

from tests.helpers import wicore

pytestmark = pytest.mark.slow


def test_bench_http_reports_both_sides_and_their_ratio(tmp_path):
    done = wicore("bench", "http", "--jobs", "40", "--json", "--out", str(tmp_path), timeout=300)
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["jobs"] == 40
    for side in ("producer", "gateway"):
        assert report[f"{side}_jobs_per_s"] > 0 and report[f"{side}_bulk_jobs_per_s"] > 0
        assert 0 < report[f"{side}_p50_ms"] <= report[f"{side}_p99_ms"]
    assert report["jobs_per_s_ratio"] == round(report["producer_jobs_per_s"] / report["gateway_jobs_per_s"], 2)
    assert "the gateway costs" in done.stderr
    assert json.loads((tmp_path / f"http-{report['cpus']}cpu.json").read_text()) == report
    assert (tmp_path / f"http-{report['cpus']}cpu.png").stat().st_size > 1000
