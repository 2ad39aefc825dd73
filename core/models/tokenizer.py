"""A small Gemma-style tokenizer trained locally (no hub).

Same conventions as Gemma-3's own tokenizer: spaces become "▁", unknown bytes fall back to
the 256 `<0xNN>` tokens, and the Gemma-3 special tokens keep their roles (`<bos>`, `<eos>`,
turn markers, `<start_of_image>` / `<end_of_image>` around `<image_soft_token>` placeholders),
so `Gemma3Processor` and the chat template treat it exactly like the real one.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK, MASK = "<pad>", "<eos>", "<bos>", "<unk>", "<mask>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
BOI, EOI, IMAGE_SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# Ids 0..9 in this order; Gemma-3 uses 0=<pad>, 1=<eos>, 2=<bos>, 3=<unk> too.
SPECIAL_TOKENS = [PAD, EOS, BOS, UNK, MASK, START_OF_TURN, END_OF_TURN, BOI, EOI, IMAGE_SOFT]
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]

# Gemma-3's chat template, reduced to what wicore sends: a system turn folds into the first
# user turn, images become `<start_of_image>` (the processor expands them), roles map
# assistant -> model.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-fallback BPE on `corpus` and wrap it as a Gemma-3 tokenizer.

    Deterministic for a given corpus and vocab size (the BPE trainer breaks ties by order).
    """
    bpe = Tokenizer(models.BPE(unk_token=UNK, byte_fallback=True, fuse_unk=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + BYTE_TOKENS,
        initial_alphabet=["▁", "\n"],
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    return wrap_tokenizer(bpe)


def wrap_tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        mask_token=MASK,
        additional_special_tokens=[START_OF_TURN, END_OF_TURN, BOI, EOI, IMAGE_SOFT],
        extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_SOFT},
        padding_side="left",
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
