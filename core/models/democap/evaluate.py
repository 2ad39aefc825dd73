"""Exact-match accuracy of a captioner checkpoint on fresh images, through the `reference` engine.

    python -m wicore.models.democap.evaluate --model DIR --n 1000 --seed 1000
    python -m wicore.models.democap.evaluate --model DIR --renderer alt --n 1000 --seed 2000

Images are made as files (PNG/JPEG bytes), then opened as a user's would be
(`PIL.Image.open(...).convert("RGB")`) and captioned with `DEFAULT_PROMPT`, greedy, 16 new
tokens. Training uses seeds 1 and 2; evaluation seeds should be >= 1000.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from wicore.engines.base import EngineConfig, EngineRequest
from wicore.engines.reference import ReferenceEngine
from wicore.models.democap import alt_render, data
from wicore.models.democap.model import chat
from wicore.schemas import GenerationParams

Sampler = Callable[[int, int], list[tuple[bytes, str]]]  # (n, seed) -> [(file bytes, caption)]


def main_samples(n: int, seed: int) -> list[tuple[bytes, str]]:
    return [(data.image_bytes(s), s.caption) for s in data.sample_specs(n, seed)]


RENDERERS: dict[str, Sampler] = {"main": main_samples, "alt": alt_render.sample}


@dataclass
class Report:
    total: int = 0
    correct: int = 0
    by_shape: Counter = field(default_factory=Counter)  # shape -> errors
    mistakes: list[tuple[str, str]] = field(default_factory=list)  # (truth, output), first 20
    outputs: list[str] = field(default_factory=list)  # every output, in sample order

    @property
    def accuracy(self) -> float:
        return self.correct / max(1, self.total)

    def add(self, truth: str, output: str) -> None:
        self.total += 1
        self.outputs.append(output)
        if output == truth:
            self.correct += 1
            return
        self.by_shape[truth.split()[2]] += 1
        if len(self.mistakes) < 20:
            self.mistakes.append((truth, output))


def evaluate(model_dir: str, samples: list[tuple[bytes, str]], batch_size: int = 32) -> Report:
    engine = ReferenceEngine(EngineConfig(model_dir, max_batch_size=batch_size))
    report = Report()
    params = GenerationParams(max_new_tokens=16)
    for start, batch in chunks(samples, batch_size):
        requests = [
            EngineRequest(f"img-{start + i}", chat(), [data.decode(raw)], params) for i, (raw, _) in enumerate(batch)
        ]
        for (_, truth), done in zip(batch, engine.generate(requests)):
            report.add(truth, done.text if done.ok else f"<error: {done.error}>")
    engine.close()
    return report


def chunks(items: list, size: int) -> Iterator[tuple[int, list]]:
    for start in range(0, len(items), size):
        yield start, items[start : start + size]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint folder (from `train --out`)")
    parser.add_argument("--renderer", choices=sorted(RENDERERS), default="main")
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    clock = time.perf_counter()
    samples = RENDERERS[args.renderer](args.n, args.seed)
    made_s = time.perf_counter() - clock
    report = evaluate(args.model, samples, args.batch_size)
    summary = {
        "renderer": args.renderer,
        "seed": args.seed,
        "n": report.total,
        "exact_match": round(report.accuracy, 4),
        "errors_by_shape": dict(report.by_shape),
        "mistakes": report.mistakes,
        "render_s": round(made_s, 1),
        "caption_s": round(time.perf_counter() - clock - made_s, 1),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
