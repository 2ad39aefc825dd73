"""`wicore bench burst` end to end on a short burst: every chat completion is answered 200 or 429
(never anything else), both sides see the same requests, and the report and plot are written."""

from __future__ import annotations

import json

import pytest

from tests.helpers import wicore

pytestmark = pytest.mark.slow


def test_bench_burst_answers_every_request_and_writes_its_report(tmp_path):
    done = wicore("bench", "burst", "--factor", "4", "--seconds", "2", "--rate-jobs", "16", "--json",
                  "--out", str(tmp_path), timeout=600)  # fmt: skip
    report = json.loads(done.stdout.splitlines()[-1])
    sent = report["uncapped_accepted"]
    assert sent > 0 and report["capped_accepted"] + report["capped_refused_429"] == sent
    assert report["capped_other_statuses"] == report["uncapped_other_statuses"] == {}
    assert report["uncapped_refused_429"] == 0 and report["capped_cap"] >= 1
    assert json.loads((tmp_path / f"burst-{report['cpus']}cpu.json").read_text()) == report
    assert (tmp_path / f"burst-{report['cpus']}cpu.png").stat().st_size > 1000
