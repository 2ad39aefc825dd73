"""Streamed text (`IncrementalText`, `Engine.stream_deltas`): deltas decoded step by step add up
to the whole text's decode, multi-byte characters split over several tokens included, with
tokenizers built here (byte-level BPE, and SentencePiece-style byte fallback) and the demo
captioner's."""

from __future__ import annotations

import random

import pytest

from wicore.engines.base import IncrementalText, stop_hold_back
from wicore.schemas import GenerationParams

CORPUS = ["a red circle on a blue background", "héllo wörld", "漢字 and kana かな", "party 🎉 time ☃", "naïve café"]
SAMPLES = ["héllo 漢字 🎉🎉 ok", "a red circle ☃ on a blue café", "  two  spaces\nand a newline かな"]


def byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw)


def byte_fallback_tokenizer():
    """Gemma's layout: "▁" for spaces, `<0xNN>` tokens (ordinary vocabulary) for unknown bytes."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for word in ("a", "▁red", "▁circle", "▁on", "▁blue", "▁ok", "▁", "h", "llo", "e", "▁and"):
        vocab.setdefault(word, len(vocab))
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizers.Replace(" ", "▁")
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")


def streamed(tokenizer, ids: list[int], rng: random.Random, hold_back: int = 0) -> list[str]:
    """The deltas of `ids` arriving a few at a time (a fast-engine step lands 1 to 3 at once),
    then, as the gateway sends it, the whole text's rest. What was sent before the end is always
    a prefix of the whole text."""
    text, pieces, n = IncrementalText(tokenizer, hold_back), [], 0
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 3))
        assert text.sent == sum(map(len, pieces))
        if new := text.update(ids[:n]):
            pieces.append(new)
    sent = "".join(pieces)
    assert whole.startswith(sent), (sent, whole)
    return pieces + ([whole[len(sent) :]] if len(whole) > len(sent) else [])


@pytest.mark.parametrize("make", [byte_level_tokenizer, byte_fallback_tokenizer])
def test_deltas_add_up_to_the_whole_decode_multi_byte_characters_too(make):
    tokenizer, rng = make(), random.Random(7)
    for sample in SAMPLES:
        ids = tokenizer.encode(sample, add_special_tokens=False)
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert any(ord(c) > 127 for c in whole) and len(ids) > len(sample.split())
        for _ in range(20):
            pieces = streamed(tokenizer, ids, rng)
            assert "".join(pieces) == whole and len(pieces) > 2
            assert all("\ufffd" not in piece for piece in pieces), "a character is never sent half-decoded"


@pytest.mark.parametrize("make", [byte_level_tokenizer, byte_fallback_tokenizer])
def test_random_ids_never_send_what_the_whole_text_lacks(make):
    """Whatever ids come (invalid byte runs too), what was sent is a prefix of the whole decode:
    the final text's rest completes it."""
    tokenizer, rng = make(), random.Random(11)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 24))]
        assert "".join(streamed(tokenizer, ids, rng)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_demo_captioners_captions_stream_word_by_word():
    from transformers import AutoTokenizer

    from wicore.models import DEMOCAP_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEMOCAP_DIR)
    ids = tokenizer.encode("a red circle on a blue background", add_special_tokens=False) + [tokenizer.eos_token_id]
    pieces = streamed(tokenizer, ids, random.Random(3))
    assert "".join(pieces) == "a red circle on a blue background" and len(pieces) >= 3


def test_a_stop_string_holds_back_its_length_less_one():
    tokenizer = byte_level_tokenizer()
    params = GenerationParams(stop=("blue", "ok"))
    assert stop_hold_back(params) == 3 and stop_hold_back(GenerationParams()) == 0
    ids = tokenizer.encode("a red circle on a blue", add_special_tokens=False)
    pieces = streamed(tokenizer, ids, random.Random(1), hold_back=stop_hold_back(params))
    assert "".join(pieces[:-1]) == "a red circle on a blue"[:-3] and pieces[-1] == "lue"


def test_the_fast_engine_streams_deltas_that_add_up_to_each_completions_text(fast_engine):
    """Random weights sample any token (byte pieces, special ones): every streaming request's
    deltas are a prefix of its text, the completion's rest ends it; a request that does not
    stream has no deltas."""
    from tests.fast_requests import request

    requests = [request(f"s{i}", variant=i, max_new_tokens=40, temperature=1.0, seed=i, stream=True) for i in range(3)]
    requests.append(request("plain", variant=3, max_new_tokens=40, ignore_eos=True))
    fast_engine.add(requests)
    sent: dict[str, str] = {}
    steps_with_text: dict[str, int] = {}
    done = {}
    while fast_engine.num_unfinished():
        done.update((c.id, c) for c in fast_engine.step())
        for delta in fast_engine.stream_deltas():
            assert delta.at == len(sent.get(delta.id, ""))
            sent[delta.id] = sent.get(delta.id, "") + delta.text
            steps_with_text[delta.id] = steps_with_text.get(delta.id, 0) + 1
    assert "plain" not in sent and not fast_engine.stream_texts
    for rid in ("s0", "s1", "s2"):
        text = done[rid].text
        assert text.startswith(sent.get(rid, "")), (sent.get(rid), text)
    assert max(steps_with_text.values()) >= 3
