"""wicore.cli.output_file: what an output file already answers, each input keeping its newest
line (JSONL) or row (Parquet), and one run per file."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from wicore.cli.output_file import OutputBusy, open_sink, read_answers, run_lock
from wicore.schemas import ResultLine


def line(input: str, text: str | None = None, error: str | None = None) -> ResultLine:
    status = "failed" if error else "finished"
    return ResultLine(input=input, job_id=None, status=status, text=text, error=error)


def test_jsonl_keeps_the_newest_line_of_each_input_and_cleans_a_killed_runs_leftovers(tmp_path):
    out = tmp_path / "out.jsonl"
    leftovers = [line("a", error="ImageError: x"), line("b", "b1"), line("a", "a2")]  # a run killed before its cleanup
    out.write_text("".join(item.model_dump_json() + "\n" for item in leftovers) + '{"input": "torn')
    answers = read_answers(out)
    assert answers.ok == {"a": True, "b": True} and answers.settled(skip_errors=False) == {"a", "b"}
    sink = open_sink(out, answers)
    sink.write(line("c", error="ImageError: y"))
    sink.close()
    assert [json.loads(text)["input"] for text in out.read_text().splitlines()] == ["b", "a", "c"]
    assert read_answers(out).settled(skip_errors=False) == {"a", "b"}
    assert read_answers(out).settled(skip_errors=True) == {"a", "b", "c"}


def test_parquet_rows_land_in_row_groups_and_a_rerun_replaces_only_its_inputs(tmp_path):
    out = tmp_path / "out.parquet"
    sink = open_sink(out, read_answers(out))
    for i in range(300):
        sink.write(line(f"k{i}", error="ImageError: bad") if i % 100 == 0 else line(f"k{i}", f"t{i}"))
    sink.close()
    assert pq.ParquetFile(out).num_row_groups == 2 and len(pq.read_table(out)) == 300
    answers = read_answers(out)
    assert answers.settled(skip_errors=False) == {f"k{i}" for i in range(300) if i % 100}
    rerun = open_sink(out, answers)
    rerun.write(line("k100", "fixed"))
    rerun.close()
    rows = {row["input"]: row for row in pq.read_table(out).to_pylist()}
    assert len(rows) == 300 and rows["k100"]["text"] == "fixed" and rows["k100"]["error"] is None
    assert rows["k0"]["error"] == "ImageError: bad" and rows["k5"]["text"] == "t5"


def test_a_second_holder_of_the_lock_is_refused_with_the_first_ones_pid(tmp_path):
    out = tmp_path / "out.jsonl"
    busy = r"is being written by another run \(pid \d+ on .+ since "
    with run_lock(out), pytest.raises(OutputBusy, match=busy), run_lock(out):
        pass
    with run_lock(out):  # released: the next run takes it
        pass
    assert not (tmp_path / "out.jsonl.lock").exists()
