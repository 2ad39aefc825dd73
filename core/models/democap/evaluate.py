"""Exact-match accuracy of the demo captioner on fresh images, through `wicore caption`.

    python -m wicore.models.democap.evaluate --n 1000 --seed 1000 --engine reference
    python -m wicore.models.democap.evaluate --n 1000 --seed 1000 --engine fast
    python -m wicore.models.democap.evaluate --renderer alt --n 1000 --seed 2000
    python -m wicore.models.democap.evaluate --n 1000 --seed 1000 --layout text-first

Images are written as files (PNG/JPEG) into a folder, then the real CLI captions the folder
(embedded Redis, a worker process, the engine; the default model unless --model), exactly as
README command 1 does; each caption is compared with the truth the file was drawn from. With
`--layout text-first` or `image-only` the CLI captions a manifest whose lines carry the
conversation in that layout (`model.chat`) instead of the folder (image first).
Training uses seeds 0-2; evaluation seeds should be >= 1000.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from wicore.models.democap import alt_render, data
from wicore.models.democap.model import LAYOUTS, chat

Sampler = Callable[[int, int], list[tuple[bytes, str]]]  # (n, seed) -> [(file bytes, caption)]


def main_samples(n: int, seed: int) -> list[tuple[bytes, str]]:
    return [(data.image_bytes(s), s.caption) for s in data.sample_specs(n, seed)]


PNG_MAGIC = b"\x89PNG"
RENDERERS: dict[str, Sampler] = {"main": main_samples, "alt": alt_render.sample}


@dataclass
class Report:
    total: int = 0
    correct: int = 0
    errors_by_shape: Counter = field(default_factory=Counter)  # the true shape -> errors
    mistakes: list[tuple[str, str]] = field(default_factory=list)  # (truth, output), first 20

    @property
    def accuracy(self) -> float:
        return self.correct / max(1, self.total)

    def add(self, truth: str, output: str | None) -> None:
        self.total += 1
        if output == truth:
            self.correct += 1
            return
        self.errors_by_shape[truth.split()[2]] += 1
        if len(self.mistakes) < 20:
            self.mistakes.append((truth, str(output)))


def write_samples(samples: list[tuple[bytes, str]], folder: Path) -> dict[str, str]:
    """Files 00000.png, 00001.jpg, ... (the format sniffed from the bytes) -> their true captions."""
    folder.mkdir(parents=True, exist_ok=True)
    truth = {}
    for i, (raw, caption) in enumerate(samples):
        suffix = "png" if raw.startswith(PNG_MAGIC) else "jpg"
        path = folder / f"{i:05d}.{suffix}"
        path.write_bytes(raw)
        truth[path.name] = caption
    return truth


def caption_folder(folder: Path, out: Path, engine: str, model: str | None, extra: list[str]) -> None:
    """README command 1 on `folder`, in a subprocess, as a user runs it."""
    cmd = [sys.executable, "-m", "wicore.cli.main", "caption", str(folder), "-o", str(out), "--engine", engine]
    cmd += ["--model", model] if model else []
    subprocess.run(cmd + extra, check=True)


def layout_manifest(folder: Path, layout: str) -> Path:
    """A manifest beside the folder: each image's line in `layout` (`model.chat`, the default prompt)."""
    manifest = folder.parent / f"{layout}.jsonl"
    lines = []
    for path in sorted(folder.iterdir()):
        turn = chat(layout=layout)[0]
        content = [{"type": "image", "image": str(path)} if p["type"] == "image" else p for p in turn["content"]]
        lines.append(json.dumps({"input": path.name, "messages": [{"role": "user", "content": content}]}) + "\n")
    manifest.write_text("".join(lines))
    return manifest


def score(truth: dict[str, str], captions: Path) -> Report:
    outputs = {}
    for line in captions.read_text().splitlines():
        record = json.loads(line)
        outputs[Path(record["input"]).name] = record["text"] if record["text"] is not None else record["error"]
    report = Report()
    for name, caption in truth.items():
        report.add(caption, outputs.get(name))
    return report


def engine_captions(engine, samples: list[tuple[bytes, str]]) -> list:
    """The samples' images through an engine object in this process (no Redis, no worker), with
    the request `wicore caption` makes of each (the default prompt and parameters): the
    benchmarks use it to compare an engine's settings on the same images. Completions in order."""
    from wicore.engines.base import EngineRequest
    from wicore.ops.image_decode import decode_image
    from wicore.schemas import DEFAULT_PROMPT, GenerationParams

    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": DEFAULT_PROMPT}]}]
    requests = [
        EngineRequest(str(i), chat, [decode_image(raw)], GenerationParams()) for i, (raw, _) in enumerate(samples)
    ]
    return engine.generate(requests)


def score_completions(samples: list[tuple[bytes, str]], completions: list) -> Report:
    report = Report()
    for (_, truth), completion in zip(samples, completions, strict=True):
        report.add(truth, completion.text if completion.ok else completion.error)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the bundled demo captioner)")
    parser.add_argument("--engine", default="reference", help="reference | fast")
    parser.add_argument("--renderer", choices=sorted(RENDERERS), default="main")
    parser.add_argument("--layout", choices=LAYOUTS, default="image-first", help="the user turn's order of parts")
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--workdir", default=None, help="folder for the images and captions (default: a temp dir)")
    args, extra = parser.parse_known_args(argv)  # anything else goes to `wicore caption`
    work = Path(args.workdir or tempfile.mkdtemp(prefix="democap-eval-"))
    clock = time.perf_counter()
    truth = write_samples(RENDERERS[args.renderer](args.n, args.seed), work / "images")
    made_s = time.perf_counter() - clock
    captions = work / f"captions-{args.engine}-{args.layout}.jsonl"
    captions.unlink(missing_ok=True)
    source = work / "images" if args.layout == "image-first" else layout_manifest(work / "images", args.layout)
    caption_folder(source, captions, args.engine, args.model, extra)
    report = score(truth, captions)
    summary = {
        "renderer": args.renderer,
        "layout": args.layout,
        "seed": args.seed,
        "engine": args.engine,
        "n": report.total,
        "exact_match": round(report.accuracy, 4),
        "errors_by_shape": dict(report.errors_by_shape),
        "mistakes": report.mistakes,
        "render_s": round(made_s, 1),
        "caption_s": round(time.perf_counter() - clock - made_s, 1),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
