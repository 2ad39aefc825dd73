"""A sequence's lifecycle: every status change goes through `Sequence.move`, which allows exactly
the moves of `TRANSITIONS`, and the status alone says whether the sequence has ended."""

from __future__ import annotations

import pytest

from wicore.engines.base import EngineRequest
from wicore.engines.fast.prompt_inputs import Prompt
from wicore.engines.fast.sequence import FINAL, TRANSITIONS, IllegalTransition, SeqStatus, Sequence
from wicore.schemas import GenerationParams

# A legal path from WAITING to each status.
PATHS = {
    SeqStatus.WAITING: [],
    SeqStatus.VISION: [SeqStatus.VISION],
    SeqStatus.PREFILL: [SeqStatus.VISION, SeqStatus.PREFILL],
    SeqStatus.DECODE: [SeqStatus.PREFILL, SeqStatus.DECODE],
    SeqStatus.FINISHED: [SeqStatus.PREFILL, SeqStatus.DECODE, SeqStatus.FINISHED],
}


def sequence_at(status: SeqStatus) -> Sequence:
    seq = Sequence(EngineRequest("s", [], [], GenerationParams(max_new_tokens=4)), Prompt([1, 2, 3], []), seed=0)
    for step in PATHS.get(status, [status]):  # a stop is one move from WAITING
        seq.move(step)
    return seq


@pytest.mark.parametrize("start", list(SeqStatus))
def test_moves_outside_the_table_raise_and_change_nothing(start):
    for target in SeqStatus:
        seq = sequence_at(start)
        if target in TRANSITIONS[start]:
            seq.move(target)
            assert seq.status == target
        else:
            with pytest.raises(IllegalTransition, match=f"{start.value} -> {target.value}"):
                seq.move(target)
            assert seq.status == start


def test_the_table_covers_every_status_and_final_ones_lead_nowhere():
    assert set(TRANSITIONS) == set(SeqStatus)
    assert all(TRANSITIONS[status] == frozenset() for status in FINAL)
    reachable = set().union(*TRANSITIONS.values()) | {SeqStatus.WAITING}
    assert reachable == set(SeqStatus)


def test_ended_is_derived_from_the_status():
    assert [s for s in SeqStatus if sequence_at(s).ended] == sorted(FINAL, key=list(SeqStatus).index)
    with pytest.raises(AttributeError):
        sequence_at(SeqStatus.DECODE).status = SeqStatus.FINISHED  # only `move` changes it


def test_wants_decode_only_while_decoding_and_tokens_remain():
    seq = sequence_at(SeqStatus.DECODE)
    seq.tokens.launched = 3
    assert seq.wants_decode and seq.next_position == 3 + 3 - 1
    seq.tokens.launched = 4  # max_new_tokens launched
    assert not seq.wants_decode
    assert not sequence_at(SeqStatus.PREFILL).wants_decode
