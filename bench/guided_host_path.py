"""The host's share of a guided decode step, without a GPU: one step's masks filled for B
sequences under the benchmark's JSON schema with the Gemma-3-4B shape's tokenizer (262,208
logits), then each row's sampled token accepted, as `GuidedHost` does between a forward's
launch and its sampling. Tokens are drawn at random from each row's allowed set (a seeded
model's choice); a row whose grammar ended starts again.

python -m bench.guided_host_path --out bench/results/guided-host-path-2cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

STEPS = 60


def allowed_token(row: torch.Tensor, rng: random.Random) -> int:
    words = torch.nonzero(row).flatten().tolist()
    word = rng.choice(words)
    bits = int(row[word]) & 0xFFFFFFFF
    return word * 32 + rng.choice([i for i in range(32) if bits >> i & 1])


def measure(grammars, spec, vocab: int, batch: int, rng: random.Random) -> dict:
    from wicore.engines.guided import MaskRows

    states = [grammars.state(spec) for _ in range(batch)]
    masks = MaskRows("cpu")
    fill, accept = [], []
    for _ in range(STEPS):
        bitmask = masks.take(batch, vocab)
        start = time.perf_counter()
        masks.fill(bitmask, [state.matcher for state in states])
        fill.append(time.perf_counter() - start)
        tokens = [allowed_token(bitmask[r], rng) for r in range(batch)]
        start = time.perf_counter()
        for state, token in zip(states, tokens, strict=True):
            state.accept(token)
        accept.append(time.perf_counter() - start)
        states = [state if state.active else grammars.state(spec) for state in states]
    return {
        "batch": batch,
        "fill_ms_p50": 1e3 * statistics.median(fill),
        "accept_ms_p50": 1e3 * statistics.median(accept),
    }


def main() -> None:
    from transformers import AutoConfig, AutoTokenizer

    from wicore.bench.guided_bench import SCHEMA
    from wicore.engines.guided import Grammars
    from wicore.models.gemma3 import make_seeded
    from wicore.schemas import GuidedSpec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/wicore-guided-host"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/guided-host-path-2cpu.json"))
    args = parser.parse_args()
    model_dir = make_seeded(args.workdir / "gemma3-4b", "gemma3-4b")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).text_config.vocab_size
    eos = frozenset({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")})
    grammars, spec = Grammars(tokenizer, vocab, eos), GuidedSpec(json_schema=SCHEMA)
    start = time.perf_counter()
    grammars.compiled(spec)
    first_compile_s = time.perf_counter() - start
    rng = random.Random(0)
    rows = [measure(grammars, spec, vocab, batch, rng) for batch in (32, 64, 128, 256)]
    report = {"command": "python -m bench.guided_host_path", "vocab": vocab, "schema": SCHEMA,
              "first_compile_s": first_compile_s, "steps": STEPS, "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    for row in rows:
        print(json.dumps(row))
    print(f"first compile {first_compile_s:.2f} s; wrote {args.out}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [row["batch"] for row in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [row["fill_ms_p50"] for row in rows], marker="o", label="fill the masks (xgrammar, batched)")
    ax.plot(batches, [row["accept_ms_p50"] for row in rows], marker="o", label="accept the sampled tokens")
    ax.set_xlabel("guided sequences in the step")
    ax.set_ylabel("host ms per step (p50, 2 CPU cores)")
    ax.set_title("Guided step's host work, Gemma-3-4B vocabulary, JSON schema")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
