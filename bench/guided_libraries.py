"""Which grammar library enforces `guided` outputs: xgrammar 0.2.8 vs llguidance 1.9.1 on the CPU.

For each tokenizer (the demo captioner's ~1k vocab, the seeded gemma3-4b preset's 262,208 ids),
each library: the tokenizer set-up once, the compile of the test schema (first use, then a
different schema of the same size), and the host time per generated token of a matcher: fill
its bitmask row and accept the token, along the tokens of a valid output (TARGET) then EOS. For
xgrammar also one engine step's host time for 384 guided rows (the caption bench's batch).

python bench/guided_libraries.py bench/results/guided-libraries-2cpu.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from wicore.models.corpus import COLORS, SHAPES

SCHEMA = {
    "type": "object",
    "properties": {
        "shape": {"enum": SHAPES},
        "color": {"enum": COLORS},
        "background": {"enum": COLORS},
    },
    "required": ["shape", "color", "background"],
    "additionalProperties": False,
}


def other_schema(n: int) -> dict:
    return {**SCHEMA, "properties": {**SCHEMA["properties"], f"extra{n}": {"type": "integer"}}}


def tokenizers() -> dict[str, object]:
    import tempfile

    from transformers import AutoTokenizer

    from wicore.models import DEMOCAP_DIR
    from wicore.models.gemma3 import make_seeded

    seeded = make_seeded(tempfile.mkdtemp(), "gemma3-4b")
    return {"democap": AutoTokenizer.from_pretrained(DEMOCAP_DIR), "gemma3-4b": AutoTokenizer.from_pretrained(seeded)}


BATCH_ROWS = 384  # the caption bench's running sequences
TARGET = '{"shape": "circle", "color": "red", "background": "blue"}'


def walk(new_matcher, fill, accept, ids: list[int], rounds: int = 5) -> dict:
    """Host time of fill + accept per token along `ids` (the target's tokens, then EOS): the
    first matcher's first mask apart (libraries build lazily), then the mean over `rounds` more."""
    matcher = new_matcher()
    start = time.perf_counter()
    fill(matcher)
    first = time.perf_counter() - start
    for token in ids:
        fill(matcher)
        accept(matcher, token)
    start = time.perf_counter()
    for _ in range(rounds):
        matcher = new_matcher()
        for token in ids:
            fill(matcher)
            accept(matcher, token)
    per_token = (time.perf_counter() - start) / (rounds * len(ids))
    return {"first_mask_ms": first * 1e3, "per_token_us": per_token * 1e6, "tokens": len(ids)}


def xgrammar_figures(tokenizer, vocab: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    compiler.compile_json_schema(json.dumps(other_schema(1)))
    t3 = time.perf_counter()
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def accept(matcher, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")

    ids = tokenizer.encode(TARGET, add_special_tokens=False) + [tokenizer.eos_token_id]
    walked = walk(lambda: xgr.GrammarMatcher(compiled), lambda m: m.fill_next_token_bitmask(bitmask, 0), accept, ids)
    batch = batch_step_ms(xgr, compiled, vocab, ids)
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "compile_again_s": t3 - t2, **walked, **batch}


def batch_step_ms(xgr, compiled, vocab: int, ids: list[int], rows: int = BATCH_ROWS) -> dict:
    """Host milliseconds per engine step of `rows` guided sequences: their bitmask rows filled
    by xgrammar's BatchGrammarMatcher (what engines/guided.py does), then each accepts a token."""
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    filler = xgr.BatchGrammarMatcher()
    fill_s = accept_s = 0.0
    for token in ids:
        start = time.perf_counter()
        filler.batch_fill_next_token_bitmask(matchers, bitmask)
        middle = time.perf_counter()
        for matcher in matchers:
            matcher.accept_token(token)
        fill_s, accept_s = fill_s + middle - start, accept_s + time.perf_counter() - middle
    return {
        "batch_rows": rows,
        "batch_fill_ms_per_step": fill_s * 1e3 / len(ids),
        "batch_accept_ms_per_step": accept_s * 1e3 / len(ids),
    }


def llguidance_figures(tokenizer, vocab: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    llguidance.LLMatcher(lltok, grammar)
    t2 = time.perf_counter()
    llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(other_schema(1))))
    t3 = time.perf_counter()
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def accept(matcher, token: int) -> None:
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")

    ids = tokenizer.encode(TARGET, add_special_tokens=False) + [tokenizer.eos_token_id]
    try:
        walked = walk(
            lambda: llguidance.LLMatcher(lltok, grammar),
            lambda m: llguidance.torch.fill_next_token_bitmask(m, bitmask, 0),
            accept,
            ids,
        )
    except RuntimeError as exc:  # its HF import misreads this tokenizer's <0xNN> byte tokens
        walked = {"error": str(exc).splitlines()[0]}
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "compile_again_s": t3 - t2, **walked}


def main(out: str) -> None:
    import importlib.metadata as md

    results = {
        "machine": "2 CPU cores, no GPU",
        "versions": {name: md.version(name) for name in ("xgrammar", "llguidance", "torch")},
        "schema": SCHEMA,
        "target": TARGET,
        "by_tokenizer": {},
    }
    torch.set_num_threads(2)
    for name, tokenizer in tokenizers().items():
        vocab = len(tokenizer)
        row = {
            "vocab": vocab,
            "xgrammar": xgrammar_figures(tokenizer, vocab),
            "llguidance": llguidance_figures(tokenizer, vocab),
        }
        results["by_tokenizer"][name] = row
        print(name, json.dumps(row, indent=1))
    Path(out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/guided-libraries-2cpu.json")
