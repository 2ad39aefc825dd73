"""`guided` outputs enforced token by token (xgrammar): grammars compiled once per spec, one
matcher per sequence, the token bitmask filled on the host and applied to the logits before
sampling.

`Grammars` belongs to an engine (one tokenizer, one logits width): it compiles a spec on first
use and keeps the last `CACHE_SIZE` compiled grammars, keyed by the sha256 of the spec's
canonical JSON. `GrammarState` is one sequence's matcher; it accepts each sampled token, and once
its grammar has ended (it accepted EOS) it masks nothing more: the engine ends the sequence on
that EOS (finish_reason stop). A grammar that never ends runs to max_new_tokens (length).

`mask_logits` is the whole hook of a sampler: it fills the bitmask rows of the constrained
sequences only ([R, ceil(V / 32)] int32 in a reused host buffer, `MaskRows`), copies them to the
logits' device and applies them there in place (a kernel on CUDA, xgrammar's torch path on the
CPU); free rows are left alone. `GuidedHost` does both halves of a fast-engine step (the last
tokens accepted, then the mask) and keeps their host seconds, which the engine's stats report.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from wicore.errors import BadGrammar
from wicore.grammars import available, grammar_of
from wicore.schemas import GuidedSpec

CACHE_SIZE = 256  # compiled grammars kept per engine (a JSON schema's: tens of KB)
NOT_INSTALLED = "guided outputs need the guided extra on the worker: pip install 'wicore[guided]'"


def spec_key(spec: GuidedSpec) -> str:
    return hashlib.sha256(spec.canonical().encode()).hexdigest()


class Grammars:
    """Compiled grammars of one tokenizer, bounded LRU by spec hash."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int], capacity: int = CACHE_SIZE):
        self.tokenizer, self.vocab_size, self.eos_ids, self.capacity = tokenizer, vocab_size, eos_ids, capacity
        self._compiler: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self.compiles = 0  # grammars compiled (a cache hit compiles none)

    def state(self, spec: GuidedSpec | None) -> GrammarState | None:
        """A fresh matcher for `spec` (None: a free sequence); BadGrammar when it cannot be one."""
        if spec is None:
            return None
        compiled = self.compiled(spec)
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled))

    def compiled(self, spec: GuidedSpec) -> Any:
        if not available():
            raise BadGrammar(NOT_INSTALLED)
        key = spec_key(spec)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        try:
            grammar = grammar_of(spec)
        except ValueError as exc:
            raise BadGrammar(str(exc)) from None
        compiled = self._ensure_compiler().compile_grammar(grammar)
        self.compiles += 1
        self._compiled[key] = compiled
        if len(self._compiled) > self.capacity:
            self._compiled.popitem(last=False)
        return compiled

    def _ensure_compiler(self) -> Any:
        """Built on the first guided request: a 262k vocabulary takes ~0.5 s to index."""
        if self._compiler is None:
            if not available():
                raise BadGrammar(NOT_INSTALLED)
            import xgrammar as xgr

            stops = sorted(i for i in self.eos_ids if i < self.vocab_size)
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=stops)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler


class GrammarState:
    """One sequence's matcher. `pending` holds tokens sampled on the device and not yet
    accepted, as (read, index): `read()` gives that step's tokens on the host."""

    def __init__(self, matcher: Any):
        self.matcher = matcher
        self.pending: list[tuple[Callable[[], list[int]], int]] = []
        self.broken = False  # a token the grammar refused (cannot happen under its own mask)

    @property
    def active(self) -> bool:
        return not self.broken and not self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        if self.active and not self.matcher.accept_token(token):
            self.broken = True

    def catch_up(self, reads: dict[int, list[int]]) -> None:
        """Accept every pending token; `reads` memoizes each step's tokens (id(read) -> tokens)."""
        for read, index in self.pending:
            tokens = reads.get(id(read))
            if tokens is None:
                tokens = reads[id(read)] = read()
            self.accept(tokens[index])
        self.pending.clear()


def mask_logits(
    logits: torch.Tensor, states: Sequence[GrammarState | None], masks: MaskRows | None = None
) -> torch.Tensor:
    """logits [B, V] with every active grammar row's disallowed tokens at -inf (in place)."""
    rows = [i for i, state in enumerate(states) if state is not None and state.active]
    if not rows:
        return logits
    import xgrammar as xgr

    masks = masks if masks is not None else MaskRows(logits.device)
    bitmask = masks.take(len(rows), logits.shape[-1])  # [R, ceil(V / 32)] int32
    masks.fill(bitmask, [states[i].matcher for i in rows])  # type: ignore[union-attr]
    device_mask = masks.upload(bitmask)
    if len(rows) == len(states):
        xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=logits.shape[-1])
        return logits
    index = torch.tensor(rows, device=logits.device)
    constrained = logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(constrained, device_mask, vocab_size=logits.shape[-1])
    return logits.index_copy_(0, index, constrained)


class MaskRows:
    """The host bitmask of one step's constrained rows, reused step after step: pinned on CUDA
    (its copy to the device is asynchronous, and the next fill waits for it to have left)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.host: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None
        self.filler: Any = None  # xgrammar's BatchGrammarMatcher, made on first use

    def take(self, rows: int, vocab_size: int) -> torch.Tensor:
        """A [rows, ceil(vocab / 32)] int32 host mask, to be filled row by row."""
        width = (vocab_size + 31) // 32
        if self.host is None or self.host.shape[0] < rows or self.host.shape[1] != width:
            self.host = torch.empty((rows, width), dtype=torch.int32, pin_memory=self.pinned)
            self.copied = None
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has left this buffer
        return self.host[:rows]

    def fill(self, bitmask: torch.Tensor, matchers: list[Any]) -> None:
        """Row r of `bitmask` from matchers[r], on xgrammar's threads (its C++ holds no GIL)."""
        if self.filler is None:
            import xgrammar as xgr

            self.filler = xgr.BatchGrammarMatcher()
        self.filler.batch_fill_next_token_bitmask(matchers, bitmask)

    def upload(self, bitmask: torch.Tensor) -> torch.Tensor:
        if not self.pinned:
            return bitmask.to(self.device)
        on_device = bitmask.to(self.device, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return on_device


class GuidedHost:
    """The host half of a guided decode step, timed: `wait_s` reading the last step's tokens back
    and accepting them (a guided step cannot sample before those have landed), `mask_s` filling
    and applying the mask. A batch with no grammar costs one scan of its rows."""

    def __init__(self, device: torch.device | str):
        self.masks = MaskRows(device)
        self.steps, self.wait_s, self.mask_s = 0, 0.0, 0.0

    def mask(self, logits: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
        if all(state is None for state in states):
            return logits
        start = time.perf_counter()
        catch_up(states)
        caught_up = time.perf_counter()
        logits = mask_logits(logits, states, self.masks)
        self.steps += 1
        self.wait_s += caught_up - start
        self.mask_s += time.perf_counter() - caught_up
        return logits

    def stats(self) -> dict:
        return {"guided_steps": self.steps, "guided_wait_s": self.wait_s, "guided_mask_s": self.mask_s}


def catch_up(states: Sequence[GrammarState | None]) -> Sequence[GrammarState | None]:
    """Every state's pending tokens accepted (each step's tokens read once); returns `states`."""
    reads: dict[int, list[int]] = {}
    for state in states:
        if state is not None and state.pending:
            state.catch_up(reads)
    return states


def track(states: Sequence[GrammarState | None], read: Callable[[], list[int]]) -> None:
    """Row i of the step `read` reads back is states[i]'s next token."""
    for index, state in enumerate(states):
        if state is not None:
            state.pending.append((read, index))


class GuidedLogitsProcessor:
    """Hugging Face `generate`'s hook (a LogitsProcessor): row i follows `states[i]` (None: free).
    Each call first accepts the token each row sampled last (input_ids' last column)."""

    def __init__(self, states: list[GrammarState | None], prompt_len: int):
        self.states, self.prompt_len = states, prompt_len
        self.masks: MaskRows | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            last = input_ids[:, -1].tolist()
            for state, token in zip(self.states, last, strict=True):
                if state is not None:
                    state.accept(token)
        if self.masks is None:
            self.masks = MaskRows(scores.device)
        return mask_logits(scores, self.states, self.masks)
