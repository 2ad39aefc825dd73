"""Repetition, presence and frequency penalties on the device, over the tokens each row has seen.

`TokenHistory` keeps the prompt and the sampled tokens of every penalized sequence by table row,
written on the device as tokens are sampled (the host reads tokens back steps later, so it cannot
count them itself). A step with penalized rows gathers their histories into `Penalties`, which
counts tokens with one scatter per step, for the whole batch: no loop over rows. A step without
penalized rows builds none and pays nothing.

Semantics: transformers' `repetition_penalty` over the prompt and the output (a seen token's
logit divided by it, multiplied when negative); OpenAI's `presence_penalty` (subtracted once from
a token generated before) and `frequency_penalty` (subtracted per time it was generated), over
the output alone, as vLLM applies them.
"""

from __future__ import annotations

from collections.abc import Sequence as Rows
from dataclasses import dataclass

import torch

from wicore.engines.fast.sequence import Sequence
from wicore.ops.transfer import upload


@dataclass
class Penalties:
    """One step's penalties on the device, for its P penalized rows (the others are left alone)."""

    rows: torch.Tensor | None  # [P] int64: the penalized rows' places in the batch; None: every row
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32 (1: off)
    seen: torch.Tensor  # [P, L] int64: prompt and output tokens; V (the vocabulary size) pads
    output: torch.Tensor  # [P, L] int64: output tokens alone; V elsewhere
    slots: tuple[torch.Tensor, torch.Tensor]  # [P] table rows, [P] positions: where their new tokens go

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, V] float32 -> penalized logits [B, V]."""
        if self.rows is None:
            return self._penalized(x)
        return x.index_copy(0, self.rows, self._penalized(x.index_select(0, self.rows)))

    def picked(self, tokens: torch.Tensor) -> torch.Tensor:
        """The penalized rows' entries of a [B] tensor."""
        return tokens if self.rows is None else tokens.index_select(0, self.rows)

    def _penalized(self, x: torch.Tensor) -> torch.Tensor:
        """x [P, V] -> [P, V]: one scatter each for the tokens seen and the output's counts."""
        rows, vocab = x.shape
        seen = torch.zeros((rows, vocab + 1), dtype=torch.bool, device=x.device).scatter_(1, self.seen, True)
        counts = torch.zeros((rows, vocab + 1), dtype=x.dtype, device=x.device)
        counts.scatter_add_(1, self.output, torch.ones(self.output.shape, dtype=x.dtype, device=x.device))
        seen, counts = seen[:, :vocab], counts[:, :vocab]
        repetition = self.repetition[:, None]
        x = torch.where(seen, torch.where(x < 0, x * repetition, x / repetition), x)
        return x - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0).to(x.dtype)


class TokenHistory:
    """Prompt then sampled tokens of each penalized sequence, int32 [rows + 1, width] on the
    device by table row; allocated when the first penalized sequence samples."""

    def __init__(self, rows: int, width: int, vocab: int, device):
        self.rows, self.width, self.vocab, self.device = rows, width, vocab, device
        self.tokens: torch.Tensor | None = None

    def penalties(self, seqs: Rows[Sequence], indices: Rows[int]) -> Penalties | None:
        """The penalties of a step sampling token `indices[i]` of `seqs[i]`; None when no row is
        penalized. A row's first token (index 0) writes its prompt first."""
        picks = [i for i, s in enumerate(seqs) if s.penalized]
        if not picks:
            return None
        chosen, at = [seqs[i] for i in picks], [indices[i] for i in picks]
        for seq, index in zip(chosen, at, strict=True):
            if index == 0:
                self._write_prompt(seq)
        params = [s.request.params for s in chosen]
        lengths = [s.prompt_len + i for s, i in zip(chosen, at, strict=True)]
        seen, output = self._gather(chosen, lengths)
        floats = lambda values: upload(values, self.device, torch.float32)  # noqa: E731
        return Penalties(
            rows=None if len(picks) == len(seqs) else upload(picks, self.device, torch.int64),
            presence=floats([p.presence_penalty for p in params]),
            frequency=floats([p.frequency_penalty for p in params]),
            repetition=floats([p.repetition_penalty for p in params]),
            seen=seen,
            output=output,
            slots=(
                upload([s.kv.row for s in chosen], self.device, torch.int64),
                upload(lengths, self.device, torch.int64),
            ),
        )

    def record(self, penalties: Penalties, tokens: torch.Tensor) -> None:
        """Write the penalized rows' tokens just sampled (tokens [B] on the device) at their positions."""
        self._buffer().index_put_(penalties.slots, penalties.picked(tokens).to(torch.int32))

    def _write_prompt(self, seq: Sequence) -> None:
        self._buffer()[seq.kv.row, : seq.prompt_len].copy_(upload(seq.prompt.ids, self.device, torch.int32))

    def _gather(self, seqs: Rows[Sequence], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """[P, L] seen and output tokens (L: the longest history), V where a row has none."""
        span = max(1, max(lengths))
        rows = upload([s.kv.row for s in seqs], self.device, torch.int64)
        tokens = self._buffer()[rows, :span].to(torch.int64)
        position = torch.arange(span, device=self.device)[None, :]
        seen = position < upload(lengths, self.device, torch.int64)[:, None]
        output = seen & (position >= upload([s.prompt_len for s in seqs], self.device, torch.int64)[:, None])
        return tokens.masked_fill(~seen, self.vocab), tokens.masked_fill(~output, self.vocab)

    def _buffer(self) -> torch.Tensor:
        if self.tokens is None:
            self.tokens = torch.zeros((self.rows + 1, self.width), dtype=torch.int32, device=self.device)
        return self.tokens
