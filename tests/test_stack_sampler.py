"""The stack sampler on a real thread: what it did in one stretch of its run, read back from the
written report."""

from __future__ import annotations

import json
import threading
import time

from wicore.stack_sampler import StackSampler, innermost_between


def _first_stretch(stop: threading.Event) -> None:
    while not stop.wait(0.001):
        pass


def _second_stretch(stop: threading.Event) -> None:
    while not stop.wait(0.001):
        pass


def test_a_stretch_of_the_run_reads_apart_from_the_rest(tmp_path):
    first, second, marks = threading.Event(), threading.Event(), {}

    def work():
        marks["start"] = time.time()
        _first_stretch(first)
        marks["switch"] = time.time()
        _second_stretch(second)
        marks["end"] = time.time()

    thread = threading.Thread(target=work)
    thread.start()
    with StackSampler(thread.ident, interval_s=0.002) as sampler:
        time.sleep(0.3)
        first.set()
        time.sleep(0.3)
        second.set()
        thread.join()
    sampler.write(tmp_path / "stacks.json")
    report = json.loads((tmp_path / "stacks.json").read_text())

    early = innermost_between(report, marks["start"], marks["switch"])
    late = innermost_between(report, marks["switch"], marks["end"])
    assert early["samples"] > 20 and late["samples"] > 20
    assert all("_first_stretch" in where for where, _ in early["innermost"][:1])
    assert all("_second_stretch" in where for where, _ in late["innermost"][:1])
    assert not any("_first_stretch" in where for where, _ in late["innermost"]), "the stretches do not mix"
    assert innermost_between(report, 0, marks["start"] - 1)["samples"] == 0, "nothing before the thread ran"
    whole = report["innermost"]
    assert {where for where, _ in whole} >= {early["innermost"][0][0], late["innermost"][0][0]}
