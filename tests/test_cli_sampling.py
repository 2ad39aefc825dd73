"""The sampling fields in a manifest through `wicore caption` on the demo captioner: `n` and
`logprobs` at the top level or under `params` reach the result line (its choices and logprobs);
a line over max_n or with a malformed field gets its own error and the others run; a bad max_n
setting is one line and exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import wicore

pytestmark = pytest.mark.slow

IMAGE = sorted((Path(__file__).resolve().parents[1] / "examples" / "images").iterdir())[0]


def caption_of(path: Path) -> str:
    color, shape, _, background = path.stem.split("-")
    article = lambda word: "an" if word[0] in "aeiou" else "a"  # noqa: E731
    return f"{article(color)} {color} {shape} on {article(background)} {background} background"


def test_manifest_lines_ask_for_samples_and_logprobs(tmp_path):
    shutil.copy(IMAGE, tmp_path / IMAGE.name)
    lines = [
        {"image": IMAGE.name, "input": "top", "n": 2, "logprobs": True, "top_logprobs": 1},
        {"image": IMAGE.name, "input": "nested", "params": {"n": 3, "repetition_penalty": 1.05}},
        {"image": IMAGE.name, "input": "over", "n": 5},
        {"image": IMAGE.name, "input": "bad", "presence_penalty": 7},
        {"image": IMAGE.name, "input": "twice", "n": 2, "params": {"n": 2}},
    ]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "WICORE_MAX_N": "4"}
    done = wicore("caption", str(manifest), "-o", str(out), "--max-new-tokens", "24", env=env, check=False)
    assert done.returncode == 1, done.stderr  # some inputs failed
    by_input = {line["input"]: line for line in map(json.loads, out.read_text().splitlines())}
    top = by_input["top"]
    assert [c["text"] for c in top["choices"]] == [caption_of(IMAGE)] * 2
    assert len(top["logprobs"]) == len(top["choices"][0]["logprobs"]) and len(top["logprobs"][0]["top_logprobs"]) == 1
    assert [c["index"] for c in by_input["nested"]["choices"]] == [0, 1, 2]
    assert by_input["over"]["status"] == "failed" and "n: 5 samples" in by_input["over"]["error"]
    assert "max_n" in by_input["over"]["error"]
    assert "presence_penalty" in by_input[f"{manifest}:4"]["error"]
    assert "n given both at the top level and under params" in by_input[f"{manifest}:5"]["error"]


def test_a_bad_max_n_is_one_line_exit_2(tmp_path):
    done = wicore("caption", str(IMAGE), "-o", str(tmp_path / "o.jsonl"), env={"WICORE_MAX_N": "0"}, check=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "max_n" in done.stderr
