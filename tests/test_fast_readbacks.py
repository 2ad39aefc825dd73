"""Sampled tokens on their way to the host (`device_handles.Readbacks`): read in launch order,
only once landed, waited for once `READ_LAG` steps old. On CPU every readback lands at once; the
device's pace is stood in for by events this test completes."""

from __future__ import annotations

import torch

from wicore.engines.fast.device_handles import Readback, Readbacks


class DeviceEvent:
    """What a CUDA event tells the host: `query` (done yet?) and `synchronize` (wait for it)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited |= not self.done  # the host blocked until the device got there
        self.done = True


def launched(step: int) -> tuple[Readback, DeviceEvent]:
    event = DeviceEvent()
    return Readback([], torch.tensor([step]), event), event


def test_tokens_are_read_once_landed_in_launch_order_and_waited_for_only_when_due():
    readbacks = Readbacks()
    (r0, e0), (r1, e1), (r2, e2) = launched(0), launched(1), launched(2)
    for step, readback in enumerate([r0, r1, r2]):
        readbacks.add(step, readback)
    assert list(readbacks.landed(due=-1)) == [], "nothing landed, nothing due: the host goes on"
    e2.done = True
    assert list(readbacks.landed(due=-1)) == [], "a later step's tokens wait behind an earlier one's"
    assert [r.tokens() for r in readbacks.landed(due=0)] == [[0]] and e0.waited, "due: waited for"
    assert not e1.waited and len(readbacks) == 2
    e1.done = True
    assert [r.tokens() for r in readbacks.landed(due=0)] == [[1], [2]] and not e1.waited
    assert len(readbacks) == 0


def test_on_cpu_every_readback_has_landed():
    readbacks = Readbacks()
    readbacks.add(5, Readback.start([], torch.tensor([7, 8])))
    assert [r.tokens() for r in readbacks.landed(due=0)] == [[7, 8]]


def test_a_due_wait_stops_when_woken_and_the_tokens_stay_for_the_next_read():
    readbacks = Readbacks()
    (r0, e0), (r1, e1) = launched(0), launched(1)
    readbacks.add(0, r0)
    readbacks.add(1, r1)
    polls = []

    def vision_done() -> bool:  # the side stream's batch finishes on the third poll
        polls.append(1)
        return len(polls) >= 3

    assert list(readbacks.landed(due=1, wake=vision_done)) == [] and len(polls) == 3
    assert len(readbacks) == 2 and not e0.waited, "the host went back to launch; nothing was lost"
    e0.done = True
    assert [r.tokens() for r in readbacks.landed(due=0, wake=lambda: False)] == [[0]]
    e1.done = True
    assert [r.tokens() for r in readbacks.landed(due=1, wake=lambda: True)] == [[1]], "landed: read, woken or not"
