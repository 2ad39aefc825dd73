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
    """One step's penalties, row by row, on the device."""

    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32 (1: off)
    seen: torch.Tensor  # [B, L] int64: prompt and output tokens; V (the vocabulary size) pads
    output: torch.Tensor  # [B, L] int64: output tokens alone; V elsewhere

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, V] float32 -> penalized logits [B, V]."""
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
        if not any(s.penalized for s in seqs):
            return None
        for seq, index in zip(seqs, indices, strict=True):
            if index == 0 and seq.penalized:
                self._write_prompt(seq)
        params = [s.request.params for s in seqs]
        lengths = [s.prompt_len + i if s.penalized else 0 for s, i in zip(seqs, indices, strict=True)]
        starts = [s.prompt_len for s in seqs]
        seen, output = self._gather(seqs, lengths, starts)
        return Penalties(
            presence=upload([p.presence_penalty for p in params], self.device, torch.float32),
            frequency=upload([p.frequency_penalty for p in params], self.device, torch.float32),
            repetition=upload([p.repetition_penalty for p in params], self.device, torch.float32),
            seen=seen,
            output=output,
        )

    def record(self, seqs: Rows[Sequence], indices: Rows[int], tokens: torch.Tensor) -> None:
        """Write the tokens just sampled (tokens [B] on the device) at their positions."""
        rows = upload([s.kv.row for s in seqs], self.device, torch.int64)
        positions = upload([s.prompt_len + i for s, i in zip(seqs, indices, strict=True)], self.device, torch.int64)
        self._buffer().index_put_((rows, positions), tokens.to(torch.int32))

    def _write_prompt(self, seq: Sequence) -> None:
        self._buffer()[seq.kv.row, : seq.prompt_len].copy_(upload(seq.prompt.ids, self.device, torch.int32))

    def _gather(self, seqs: Rows[Sequence], lengths: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L] seen and output tokens (L: the longest history), V where a row has none."""
        span = max(1, max(lengths))
        rows = upload([s.kv.row for s in seqs], self.device, torch.int64)
        tokens = self._buffer()[rows, :span].to(torch.int64)
        position = torch.arange(span, device=self.device)[None, :]
        seen = position < upload(lengths, self.device, torch.int64)[:, None]
        output = seen & (position >= upload(starts, self.device, torch.int64)[:, None])
        return tokens.masked_fill(~seen, self.vocab), tokens.masked_fill(~output, self.vocab)

    def _buffer(self) -> torch.Tensor:
        if self.tokens is None:
            self.tokens = torch.zeros((self.rows + 1, self.width), dtype=torch.int32, device=self.device)
        return self.tokens
