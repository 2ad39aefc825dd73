"""Admission control: a cap on the jobs queued per model and lane, checked before a submission is
enqueued. Past it the submission is refused with `QueueFull`, carrying the wait estimated from how
fast the model's jobs finished over the last `RATE_WINDOW_S` (RQ's finished registries, scored
by expiry: a job finished at t with result TTL r scores t + r). The high lane has a cap of its
own, so interactive work keeps headroom however deep the bulk lanes are.

    admission = Admission(connection, caps={"high": 1000, "normal": 100000, "low": 100000})
    admission.check("democap", {"normal": 256}, result_ttl_s=86400)  # raises QueueFull
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from redis import Redis

from wicore import keys, rq_keys
from wicore.errors import QueueFull

RATE_WINDOW_S = 60  # the finish rate is measured over this many seconds
MIN_RETRY_S, MAX_RETRY_S = 1, 3600
NO_RATE_RETRY_S = 30  # the wait said when nothing finished lately (no worker yet, or all loading)

# ARGV: the model's queue name prefix ('wicore.MODEL.'), now, result TTL, window, then lanes.
# Returns the queued jobs per lane, then the model's jobs finished within the window (all lanes).
_COUNT_LUA = (
    rq_keys.LUA_PREAMBLE
    + """
local prefix, now, ttl, window = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local queued, finished = {}, 0
for i = 5, #ARGV do queued[i - 4] = 0 end
local qprefix = RQ.queue .. prefix
for _, key in ipairs(redis.call('SMEMBERS', RQ.queues)) do
  if string.sub(key, 1, #qprefix) == qprefix then
    local name = string.sub(key, #RQ.queue + 1)
    local lane = string.match(string.sub(key, #qprefix + 1), '^([a-z]+)%.')
    for i = 5, #ARGV do
      if lane == ARGV[i] then queued[i - 4] = queued[i - 4] + redis.call('LLEN', key) end
    end
    finished = finished + redis.call('ZCOUNT', RQ.finished .. name, now + ttl - window, now + ttl)
  end
end
queued[#queued + 1] = finished
return queued
"""
)


@dataclass(frozen=True)
class LaneLoad:
    queued: int
    finished_per_s: float  # the model's, all lanes


class Admission:
    def __init__(self, connection: Redis, caps: Mapping[str, int]):
        self.caps = {lane: cap for lane, cap in caps.items() if cap > 0}  # 0: no cap
        self._count = connection.register_script(_COUNT_LUA)

    def load(self, model: str, lanes: list[str], result_ttl_s: int) -> dict[str, LaneLoad]:
        """Queued jobs per lane now, and the model's finish rate: one round trip."""
        args: list[str | float] = [f"{keys.QUEUE_PREFIX}.{model}.", time.time(), result_ttl_s, RATE_WINDOW_S, *lanes]
        counts = [int(c) for c in self._count(args=args)]
        rate = counts[-1] / RATE_WINDOW_S
        return {lane: LaneLoad(queued, rate) for lane, queued in zip(lanes, counts)}

    def check(self, model: str, adding: Mapping[str, int], result_ttl_s: int) -> None:
        """Raise QueueFull when a capped lane holds its cap, or when adding `adding[lane]` jobs
        would take it past its cap (a submission larger than the cap goes into an empty lane, so
        that it can ever go)."""
        lanes = [lane for lane in adding if lane in self.caps]
        if not lanes:
            return
        for lane, load in self.load(model, lanes, result_ttl_s).items():
            cap = self.caps[lane]
            if load.queued >= cap or (load.queued and load.queued + adding[lane] > cap):
                raise QueueFull(model, lane, load.queued, cap, retry_after(load.queued + adding[lane] - cap, load))


def retry_after(excess: int, load: LaneLoad) -> int:
    """Seconds until `excess` jobs have likely finished, at the measured rate."""
    if load.finished_per_s <= 0:
        return NO_RATE_RETRY_S
    return max(MIN_RETRY_S, min(MAX_RETRY_S, math.ceil(excess / load.finished_per_s)))
