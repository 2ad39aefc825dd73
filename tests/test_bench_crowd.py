"""`wicore bench crowd` end to end on a small crowd: every chat completion and long-poll gets its
answer, and the gateway's memory and descriptors are reported."""

from __future__ import annotations

import json

import pytest

from tests.helpers import wicore

pytestmark = pytest.mark.slow


def test_bench_crowd_answers_every_request(tmp_path):
    done = wicore("bench", "crowd", "--requests", "120", "--out", str(tmp_path), timeout=300)
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["chat_statuses"] == {"200": 120} and report["poll_statuses"] == {"200": 120}, report
    for moment in ("gateway_before", "gateway_after_chat", "gateway_after"):
        assert report[moment]["rss_mib"] > 0 and report[moment]["fds"] > 0
    assert (tmp_path / "gateway.log").exists() and (tmp_path / "worker.log").exists()
