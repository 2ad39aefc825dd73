"""After a step's launches: its sequences, caches and counters brought up to date.

Its prefill batch's sequences go on to decode (and the
blocks they write become readable), those asked to stop stop; the sampled tokens that reached
the host are appended, oldest step first, and the sequences they end finish. Tokens are read
when they have landed, and waited for only once READ_LAG steps old: the host plans and launches
the next steps while the device runs, and a slow turn of the worker's loop (results written,
jobs claimed) finds steps queued on the device rather than an idle one. A sequence that ended is
decoded at most READ_LAG times more and those tokens are dropped (a sequence that ends at
max_new_tokens is never decoded past it). A step that launched nothing and ended nothing waits,
briefly, for what everything waits on.
"""

from __future__ import annotations

import time

from wicore.engines.base import Completion, aborted, failed
from wicore.engines.fast.device_handles import PhaseClock, Readbacks, RowScores
from wicore.engines.fast.engine_stats import EngineStats
from wicore.engines.fast.image_stage import ImageStage
from wicore.engines.fast.sequence import SeqStatus, Sequence
from wicore.engines.fast.step_plan import Launched, StepPlan
from wicore.engines.fast.step_planner import StepPlanner
from wicore.engines.text import finish_sequence, first_stop, token_logprobs, visible_text
from wicore.schemas import Lane

IDLE_WAIT_S = 0.02  # longest wait inside a step that launched nothing
# A step's tokens are waited for once this many later steps have launched: with 2 the device runs
# out of queued work while the host is between steps, noticeably more often than with 3.
READ_LAG = 3


def unreadable(seq: Sequence) -> Completion:
    """The completion of a sequence whose images failed to preprocess (`StepPlan.unreadable`)."""
    return failed(seq.id, f"image preprocessing failed: {seq.vision.pixels.error}", input_error=True)


class Postprocess:
    def __init__(
        self,
        planner: StepPlanner,
        images: ImageStage,
        readbacks: Readbacks,
        counters: EngineStats,
        clock: PhaseClock,
        tokenizer,
        eos_ids: frozenset[int],
    ):
        self.planner, self.images, self.readbacks, self.counters = planner, images, readbacks, counters
        self.clock, self.tokenizer, self.eos_ids = clock, tokenizer, eos_ids

    def book(self, plan: StepPlan, launched: Launched, done: list[Completion]) -> None:
        """Appends to `done` as sequences end, so a failure later in the step loses none."""
        self.counters.record_step(launched.images, plan.decode, launched.graphed, plan.prefill)
        self.planner.prefilled(plan.prefill)
        done += [self.abort(seq) for seq in plan.prefill if seq.abort_requested]
        finished = self._read_tokens(plan.number - READ_LAG, done)
        if not (plan.decode or plan.prefill or finished):
            self._wait_for_work()
        self.clock.collect()  # fold finished GPU timings in; keeps the pending list short

    def abort(self, seq: Sequence) -> Completion:
        self.images.drop(seq)
        self.planner.finish(seq, SeqStatus.ABORTED)
        self.counters.aborted += 1
        return aborted(seq.id, prompt_tokens=seq.prompt_len, engine_s=seq.age())

    def _read_tokens(self, due: int, done: list[Completion]) -> int:
        """Process the readbacks whose tokens have landed, oldest first, waiting for those
        launched in step `due` or before unless a vision batch is done meanwhile (the side stream
        then gets its next batch rather than idling behind a prefill on the main one); returns
        how many sequences ended."""
        ended, wake = 0, self.images.any_done if self.images.num_queued else None
        for readback in self.readbacks.landed(due, wake):
            tokens, scores = readback.tokens(), readback.row_scores()
            for seq, token, score in zip(readback.seqs, tokens, scores, strict=True):
                if not seq.ended and self._append(seq, token, score):
                    done.append(self._finish(seq))
                    ended += 1
        return ended

    def _append(self, seq: Sequence, token: int, score: RowScores | None = None) -> bool:
        """Record a token (and its log-probabilities); True when the sequence ends with it."""
        generated = seq.tokens.generated
        generated.append(token)
        if score is not None:
            seq.tokens.scores.append(score)
        if len(generated) == 1:
            seq.timeline["first_token"] = time.perf_counter()
        params = seq.request.params
        if len(generated) >= seq.max_new or (not params.ignore_eos and token in self.eos_ids):
            return True
        if params.stop:
            text = visible_text(self.tokenizer, generated)
            return first_stop(text, params.stop) is not None
        return False

    def _finish(self, seq: Sequence) -> Completion:
        ids, text, reason = finish_sequence(self.tokenizer, seq.tokens.generated, seq.request.params, self.eos_ids)
        self.planner.finish(seq)
        self.counters.record_finish(len(ids))
        if seq.request.priority is Lane.HIGH:
            self.counters.record_timeline(seq)
        first = seq.timeline.get("first_token")
        first_token_s = None if first is None else first - seq.added_at
        logprobs = None
        if seq.request.params.logprobs:
            logprobs = token_logprobs(self.tokenizer, ids, seq.tokens.scores[: len(ids)])
        return Completion(
            seq.id,
            text,
            ids,
            reason,
            prompt_tokens=seq.prompt_len,
            engine_s=seq.age(),
            first_token_s=first_token_s,
            logprobs=logprobs,
        )

    def _wait_for_work(self) -> None:
        """Nothing ran this step: wait (briefly, so the worker can keep admitting) for what
        everything waits on instead of spinning."""
        if self.images.num_queued:  # until it finishes, or a paced decode batch is due
            self.images.wait(min(IDLE_WAIT_S, self.planner.decode_due_in()))
        elif self.readbacks:
            self.readbacks.wait_oldest()
        elif self.planner.waiting:
            self.planner.waiting[0].vision.pixels.wait(IDLE_WAIT_S)  # admission takes the head first
