"""Canceling jobs, queued or running, as RQ's `Job.cancel` does."""

from __future__ import annotations

import time
from collections.abc import Iterable

from redis import Redis

from wicore import defaults, keys, rq_keys
from wicore.producer.submission import ProducerConfig

# ARGV: this producer's session, own-queued-only ('1' or '0'), now (unix), TTL of a canceled job
# and of a worker's cancel set, notify TTL, the key prefixes of notification lists, cancel sets
# and dedup marks, the job hash's run field (`keys.RUN_FIELD`), the key prefixes of blobs and blob
# users, then job ids. Returns each id's status afterwards:
# 'canceled', the status it keeps (ended, or not this producer's queued job when own-queued-only),
# or 'missing'. One call, so no worker claims a job between its check and its cancel; fields are
# read as plain strings (a job hash RQ could not restore cancels like any other). A canceled job
# is what RQ's `Job.cancel` makes of it (status, out of its queue and the started registry, in
# the canceled registry), its worker (if one started it) finds the run it stops (`keys.run`) in its
# cancel set, it leaves its blobs' users (a blob left with none goes), its dedup mark goes (submitting the same work again runs it, a new run that the old
# run's end leaves alone) and its producer's `wait` hears of it.
_CANCEL_LUA = (
    rq_keys.LUA_PREAMBLE
    + """
local session, own_only, now = ARGV[1], ARGV[2] == '1', tonumber(ARGV[3])
local ttl, notify_ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
local notify_prefix, cancel_prefix, marks, run_field = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local blobs, users = ARGV[10], ARGV[11]
local ended = {finished = 1, failed = 1, stopped = 1, canceled = 1}
local function expire(key, seconds)
  if seconds < 0 then redis.call('PERSIST', key) else redis.call('EXPIRE', key, math.max(seconds, 1)) end
end
local function notify_key(meta)
  local ok, decoded = pcall(cjson.decode, meta or '')
  local key = ok and type(decoded) == 'table' and decoded['notify']
  if type(key) == 'string' and #key <= 200 and string.sub(key, 1, #notify_prefix) == notify_prefix then return key end
  return nil
end
local function leave_blobs(id, meta)
  local ok, decoded = pcall(cjson.decode, meta or '')
  local shas = ok and type(decoded) == 'table' and decoded['blobs']
  if type(shas) ~= 'table' then return end
  for _, sha in ipairs(shas) do
    if type(sha) == 'string' and #sha == 64 and string.find(sha, '^%x+$') then
      redis.call('SREM', users .. sha, id)
      if redis.call('EXISTS', users .. sha) == 0 then redis.call('DEL', blobs .. sha) end
    end
  end
end
local function leave_registries(id, origin, status)
  redis.pcall('LREM', RQ.queue .. origin, 0, id)
  if status == 'started' then
    local eids = redis.pcall('ZRANGE', RQ.executions .. id, 0, -1)
    if type(eids) == 'table' and eids.err == nil then
      for _, eid in ipairs(eids) do redis.pcall('ZREM', RQ.started .. origin, id .. ':' .. eid) end
    end
  end
  redis.pcall('ZREM', RQ.deferred .. origin, id)
  redis.pcall('ZREM', RQ.scheduled .. origin, id)
  redis.pcall('ZADD', RQ.canceled .. origin, now, id)
end
local function cancel(id, job, f)
  redis.call('HSET', job, 'status', 'canceled')
  if f[2] then leave_registries(id, f[2], f[1]) end
  if f[1] == 'started' and f[3] and #f[3] <= 200 then
    redis.call('SADD', cancel_prefix .. f[3], f[5] and (id .. ':' .. f[5]) or id)
    expire(cancel_prefix .. f[3], ttl)
  end
  expire(job, ttl)
  leave_blobs(id, f[4])
  redis.call('DEL', marks .. id)
  local notify = notify_key(f[4])
  if notify then
    redis.call('RPUSH', notify, id)
    redis.call('EXPIRE', notify, notify_ttl)
  end
end
local out = {}
for i = 12, #ARGV do
  local id = ARGV[i]
  local job = RQ.job .. id
  if redis.call('TYPE', job)['ok'] ~= 'hash' then
    out[i - 11] = 'missing'
  else
    local f = redis.call('HMGET', job, 'status', 'origin', 'worker_name', 'meta', run_field)
    local mine = redis.pcall('GET', marks .. id) == session and f[1] == 'queued'
    if ended[f[1]] or (own_only and not mine) then
      out[i - 11] = f[1] or 'unknown'
    else
      cancel(id, job, f)
      out[i - 11] = 'canceled'
    end
  end
end
return out
"""
)


class Canceler:
    """Cancels jobs in one server-side call (`_CANCEL_LUA`)."""

    def __init__(self, connection: Redis, session: str, config: ProducerConfig):
        self.session, self.config = session, config
        self._cancel = connection.register_script(_CANCEL_LUA)

    def cancel(self, job_ids: Iterable[str], *, own_queued_only: bool = False) -> dict[str, str]:
        """Cancel jobs as RQ's `Job.cancel` does: a queued job leaves its queue and never runs; a
        running one is stopped by its worker at the engine's next step boundary. Either reads
        'canceled', its dedup mark goes (submitting the same work again runs it) and its producer's
        `wait` hears of it. Returns each id's status afterwards: 'canceled', the status it had
        already ended with, or 'missing'. `own_queued_only`: cancel only the jobs this producer
        enqueued that no worker has started (what `wicore caption` takes back when it stops); the
        others keep their status. One server-side call (`_CANCEL_LUA`)."""
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return {}
        ttl = self.config.result_ttl_s
        args = [self.session, int(own_queued_only), time.time(), ttl, defaults.NOTIFY_TTL_S]
        args += [keys.NOTIFY_PREFIX, keys.CANCEL_PREFIX, keys.submitted(""), keys.RUN_FIELD]
        args += [keys.blob(""), keys.blob_users(""), *ids]
        statuses = self._cancel(args=args)
        return {job_id: raw.decode(errors="replace") for job_id, raw in zip(ids, statuses)}
