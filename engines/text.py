"""Turning generated token ids into a finished text; shared by every engine so that they agree
to the character on where a sequence ends (EOS, stop string, length)."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from pathlib import Path

from wicore.schemas import FinishReason, GenerationParams, TokenLogprob, TopLogprob

# OpenAI's stand-in for the log-probability of a token that cannot be drawn (JSON has no -inf)
IMPOSSIBLE_LOGPROB = -9999.0
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token: one byte of UTF-8


def stop_token_ids(model_dir: str | Path, tokenizer) -> frozenset[int]:
    """EOS ids of the checkpoint's generation config, plus `<end_of_turn>` (Gemma chat models end
    their turn with it)."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    ids.update(eos if isinstance(eos, list) else [eos])
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        ids.add(end_of_turn)
    return frozenset(i for i in ids if i is not None)


def finish_sequence(
    tokenizer, generated: list[int], params: GenerationParams, eos_ids: frozenset[int]
) -> tuple[list[int], str, FinishReason]:
    """Cut `generated` at the first EOS (kept in the ids, not in the text) or the first stop string
    (the text ends before it; the ids end with the token that completed it)."""
    tokens: list[int] = []
    reason: FinishReason = "length"
    for token in generated[: params.max_new_tokens]:
        tokens.append(token)
        if not params.ignore_eos and token in eos_ids:
            reason = "stop"
            break
    text = visible_text(tokenizer, tokens)
    cut = first_stop(text, params.stop)
    if cut is None:
        return tokens, text, reason
    for n in range(1, len(tokens) + 1):
        if first_stop(visible_text(tokenizer, tokens[:n]), params.stop) is not None:
            tokens = tokens[:n]
            break
    return tokens, text[:cut], "stop_string"


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def token_logprobs(
    tokenizer, ids: Sequence[int], scores: Sequence[tuple[float, Sequence[tuple[int, float]]]]
) -> list[TokenLogprob]:
    """OpenAI's per-token entries: `scores[i]` is token `ids[i]`'s log-probability and its
    (id, log-probability) alternatives, best first."""
    entries = []
    for token, (logprob, top) in zip(ids, scores, strict=True):
        alternatives = tuple(_candidate(tokenizer, i, lp) for i, lp in top)
        entries.append(TokenLogprob(**_candidate(tokenizer, token, logprob).model_dump(), top_logprobs=alternatives))
    return entries


def _candidate(tokenizer, token: int, logprob: float) -> TopLogprob:
    piece = tokenizer.convert_ids_to_tokens(token)
    text = tokenizer.decode([token])
    byte = BYTE_TOKEN.fullmatch(piece) if isinstance(piece, str) else None
    raw = (int(byte.group(1), 16),) if byte else tuple(text.encode("utf-8"))
    finite = logprob if math.isfinite(logprob) else IMPOSSIBLE_LOGPROB
    return TopLogprob(token=text, logprob=max(finite, IMPOSSIBLE_LOGPROB), bytes=raw)


def visible_text(tokenizer, ids: list[int]) -> str:
    """The text of `ids` without control tokens (EOS, turn and image markers). Byte-fallback
    tokens stay: a tokenizer that registers them as special tokens would otherwise lose the
    punctuation a grammar spells with them."""
    hidden = hidden_ids(tokenizer)
    return tokenizer.decode([i for i in ids if i not in hidden], skip_special_tokens=False)


@functools.lru_cache(maxsize=8)
def hidden_ids(tokenizer) -> frozenset[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = {i for i, token in added.items() if token.special and not BYTE_TOKEN.fullmatch(token.content)}
    return frozenset(special | set(tokenizer.all_special_ids))
