"""Token selection on the device: greedy, temperature, top-k, top-p, per-request seeds.

Sampling is Gumbel-max with counter-based noise: token = argmax(logits / T + g) where
g = -log(-log(u)) and u is a hash of (request seed, token index, vocabulary id). No RNG state
is consumed, so a request draws the same tokens whatever its batch mates are, the noise needs
no host round trip and no host sync, and the whole sampler can be captured in a CUDA graph.
Top-k / top-p (applied in that order after the temperature, as transformers does) only mask
logits to -inf before the argmax. Requests with `ignore_eos` get their EOS logits masked, as
transformers' `min_new_tokens` does, so they generate exactly max_new_tokens.

A step's logits go through three stages: `adjusted` (per-row rules on the raw logits:
penalties, then token masks), the choice (argmax, or the warped logits plus noise), and, when a
row asks for them, the log-probabilities of the distribution each token was drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from wicore.engines.fast.penalties import Penalties
from wicore.ops.transfer import upload
from wicore.schemas import GenerationParams

MASK32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer finaliser (lowbias32), for Python ints and int64 tensors < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def request_key(seed: int, index: int) -> int:
    """The noise key of one token of one request (host side, pure Python)."""
    x = mix32((seed & MASK32) ^ mix32((index + 0x632BE5AB) & MASK32))
    return mix32(x ^ ((seed >> 32) & MASK32))


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, on the device. `None` fields are unused."""

    greedy_only: bool
    temperature: torch.Tensor | None = None  # [B] float32, 0 = greedy row
    top_k: torch.Tensor | None = None  # [B] int64, 0 = off (None: off for all rows)
    top_p: torch.Tensor | None = None  # [B] float32, 1 = off (None: off for all rows)
    keys: torch.Tensor | None = None  # [B] int64 noise keys
    suppress: torch.Tensor | None = None  # [B] bool: mask EOS logits (ignore_eos)
    penalties: Penalties | None = None  # None: no row is penalized
    top_logprobs: int | None = None  # None: no row asks for logprobs; else the most alternatives a row asks for
    logprob_rows: torch.Tensor | None = None  # [R] int64: the rows that ask, in order; None: all or none

    @classmethod
    def build(
        cls,
        params: list[GenerationParams],
        seeds: list[int],
        indices: list[int],
        device,
        penalties: Penalties | None = None,
        top_logprobs: int | None = None,
        logprob_rows: list[int] | None = None,
    ) -> SamplingBatch:
        """`indices`: the index (0 = first new token) of the token each row samples now;
        `top_logprobs`: the most alternatives a row asks for (None: no row asks for logprobs);
        `logprob_rows`: the rows that ask (None: every row)."""
        batch = cls._choice(params, seeds, indices, device)
        rows = None
        if top_logprobs is not None and logprob_rows is not None and len(logprob_rows) < len(params):
            rows = upload(logprob_rows, device, torch.int64)
        return replace(batch, penalties=penalties, top_logprobs=top_logprobs, logprob_rows=rows)

    def asking(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows (of a [B, ...] tensor) that ask for logprobs."""
        return rows if self.logprob_rows is None else rows.index_select(0, self.logprob_rows)

    @classmethod
    def _choice(cls, params: list[GenerationParams], seeds: list[int], indices: list[int], device) -> SamplingBatch:
        suppress = None
        if any(p.ignore_eos for p in params):
            suppress = upload([p.ignore_eos for p in params], device, torch.bool)
        if all(p.greedy for p in params):
            return cls(True, suppress=suppress)

        def tensor(values, dtype):
            return upload(values, device, dtype)

        return cls(
            False,
            temperature=tensor([p.temperature for p in params], torch.float32),
            top_k=tensor([p.top_k for p in params], torch.int64) if any(p.top_k for p in params) else None,
            top_p=tensor([p.top_p for p in params], torch.float32) if any(p.top_p < 1 for p in params) else None,
            keys=tensor([request_key(s, i) for s, i in zip(seeds, indices, strict=True)], torch.int64),
            suppress=suppress,
        )


@dataclass
class TokenScores:
    """Log-probabilities of the R rows of one step that ask for them (`logprob_rows`), on the
    device: of the token each drew, and of the `k` most likely tokens (k = the most any asks for)."""

    chosen: torch.Tensor  # [R] float32
    top_ids: torch.Tensor  # [R, k] int64
    top_logprobs: torch.Tensor  # [R, k] float32


class Sampled(NamedTuple):
    tokens: torch.Tensor  # [B] int64
    scores: TokenScores | None  # None: no row asked for logprobs


class Sampler:
    def __init__(self, vocab_size: int, eos_ids: frozenset[int], device):
        self.eos_ids = torch.tensor(sorted(i for i in eos_ids if i < vocab_size), dtype=torch.int64, device=device)
        self.token_hash = mix32((torch.arange(vocab_size, dtype=torch.int64, device=device) + 0x9E3779B9) & MASK32)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [B, V] -> token ids [B] int64."""
        return self.sample(logits, batch).tokens

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> Sampled:
        """logits [B, V] -> token ids [B], and their log-probabilities where a row asks."""
        x = self.adjusted(logits, batch)
        greedy = x.argmax(dim=-1)
        if batch.greedy_only:
            return Sampled(greedy, self._scores(x, greedy, batch))
        warped = self._warped(x, batch)
        sampled = (warped + self.gumbel(batch.keys)).argmax(dim=-1)
        drawn = batch.temperature > 0
        tokens = torch.where(drawn, sampled, greedy)
        if batch.top_logprobs is None:
            return Sampled(tokens, None)
        pick = batch.asking
        return Sampled(tokens, self._scores(torch.where(pick(drawn)[:, None], pick(warped), pick(x)), tokens, batch))

    def adjusted(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [B, V] -> float32 [B, V] after the per-row rules: penalties over the tokens seen,
        then the token masks (a masked token's logit is -inf)."""
        x = logits.float()
        if batch.penalties is not None:
            x = batch.penalties.apply(x)
        return self._masked(x, batch)

    def _masked(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Token masks: EOS for rows that ignore it."""
        if batch.suppress is not None and self.eos_ids.numel():
            eos = x[:, self.eos_ids]
            x = x.index_copy(1, self.eos_ids, eos.masked_fill(batch.suppress[:, None], float("-inf")))
        return x

    def _warped(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The sampled rows' distribution (as logits): temperature, then top-k and top-p masks."""
        temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
        x = x / temperature[:, None]
        if batch.top_k is not None:
            x = mask_top_k(x, batch.top_k)
        if batch.top_p is not None:
            x = mask_top_p(x, batch.top_p)
        return x

    @staticmethod
    def _scores(dist: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> TokenScores | None:
        """dist: the logits each asking row's token was drawn from, [R, V] (or [B, V], the asking
        rows picked here); tokens [B]."""
        if batch.top_logprobs is None:
            return None
        if dist.shape[0] == tokens.shape[0]:
            dist = batch.asking(dist)
        logprobs = torch.log_softmax(dist, dim=-1)
        top = logprobs.topk(batch.top_logprobs, dim=-1)
        return TokenScores(logprobs.gather(1, batch.asking(tokens)[:, None])[:, 0], top.indices, top.values)

    def gumbel(self, keys: torch.Tensor) -> torch.Tensor:
        """Gumbel noise [B, V] from the row keys and the vocabulary ids."""
        bits = mix32(keys[:, None] ^ self.token_hash[None, :]) >> 8  # 24 random bits
        u = (bits.float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
        return -torch.log(-torch.log(u))


def mask_top_k(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep logits >= the k-th largest of each row (k = 0: all), like transformers' TopK."""
    vocab = x.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return x.masked_fill(x < kth, float("-inf"))


def mask_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (the top token
    always stays)."""
    values, order = torch.sort(x, dim=-1, descending=True)
    probs = torch.softmax(values, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass strictly above each token
    drop_sorted = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))
