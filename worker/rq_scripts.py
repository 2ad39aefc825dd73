"""The Lua scripts behind `RQBridge`: every change a wicore worker makes to a job's RQ records is
one of these, run server-side, one call per batch.

Nothing read from a job hash is trusted: numbers go through `tonumber` with a default, a missing
field never reaches a string concatenation, and a job is settled only by the worker whose claims
list still holds it (LREM returns 1), so writing a result twice is a no-op and a job requeued by
a reaper is never also finished by the worker that lost it. Records follow RQ 3.0's (job hash,
registries, executions, result stream); tests/test_rq_bridge.py reads them back with RQ.
The scripts touch keys they compute (rq:job:<id>, ...): fine on one Redis, not on Redis Cluster.
"""

from __future__ import annotations

# Helpers shared by the scripts below (Lua has no modules in EVAL: each script starts with these).
_LIB = """
local function forget_executions(id, origin, worker_executions)
  local index = 'rq:executions:' .. id
  for _, eid in ipairs(redis.call('ZRANGE', index, 0, -1)) do
    local comp = id .. ':' .. eid
    redis.call('DEL', 'rq:execution:' .. comp)
    redis.call('ZREM', 'rq:wip:' .. origin, comp)
    redis.call('SREM', worker_executions, comp)
  end
  redis.call('DEL', index)
end

local function push(origin, id, front)
  local queue = 'rq:queue:' .. origin
  if not redis.call('LPOS', queue, id) then
    if front then redis.call('LPUSH', queue, id) else redis.call('RPUSH', queue, id) end
  end
  redis.call('SADD', 'rq:queues', queue)
end

-- A TTL as Redis takes it: an integer, -1 for "keep forever", `default` when unreadable; capped
-- at ten years (EXPIRE refuses what a huge or fractional number formats to).
local function ttl_of(value, default)
  local n = tonumber(value)
  if n == nil or n ~= n then return default end
  if n < 0 then return -1 end
  return math.min(math.floor(n), 315360000)
end

local function retries_left(id)
  local n = tonumber(redis.call('HGET', 'rq:job:' .. id, 'retries_left'))
  if n == nil or n ~= n or n < 1 then return 0 end
  return math.min(math.floor(n), 1000000)
end

-- `spend`: the job's retries_left goes down by one (it failed, or its worker died holding it).
local function requeue(id, origin, now_text, front, spend)
  local job = 'rq:job:' .. id
  if spend then redis.call('HSET', job, 'retries_left', retries_left(id) - 1) end
  redis.call('HSET', job, 'status', 'queued', 'enqueued_at', now_text)
  push(origin, id, front)
end

local function add_result(id, fields, ttl)
  local results = 'rq:results:' .. id
  redis.call('XADD', results, 'MAXLEN', '~', 10, '*', unpack(fields))
  if ttl < 0 then redis.call('PERSIST', results) else redis.call('EXPIRE', results, ttl) end
end

local function expire_job(id, ttl)
  if ttl < 0 then redis.call('PERSIST', 'rq:job:' .. id) else redis.call('EXPIRE', 'rq:job:' .. id, ttl) end
end

local function registry_score(now, ttl)
  if ttl < 0 then return '+inf' end
  return now + ttl
end

local function fail(id, origin, exc, worker, eid, started, now, now_text, default_ttl)
  local job = 'rq:job:' .. id
  local ttl = ttl_of(redis.call('HGET', job, 'failure_ttl'), default_ttl)
  redis.call('HSET', job, 'status', 'failed', 'ended_at', now_text)
  local fields = {'type', 2, 'worker_name', worker, 'exc_string', exc}
  if eid ~= '' then
    for _, v in ipairs({'execution_id', eid, 'execution_started_at', started, 'execution_ended_at', now}) do
      fields[#fields + 1] = v
    end
  end
  add_result(id, fields, ttl)
  expire_job(id, ttl)
  redis.call('ZADD', 'rq:failed:' .. origin, registry_score(now, ttl), id)
  redis.call('DEL', 'wicore:submitted:' .. id)  -- resubmitting a failed job runs it again
end
"""

# KEYS: queue, claims list, worker executions index, worker hash, claimants set, dead-letter stream,
# this worker's cancel set.
# ARGV: count, worker name, now (unix), now (RQ text), queue name, default job timeout, TTL of a
# job without timeout, TTL grace, then `count` fresh execution ids.
# Takes up to `count` jobs and starts each as RQ's worker does (status, execution hash, the job's
# executions index, the started registry, the worker's executions index). An id RQ could not have
# made, or one with no job hash, goes to the dead-letter stream; an id whose job is no longer
# queued (a duplicate entry, or a job canceled while its id sat in the queue) is dropped, never
# started. A cancel request this worker holds for a claimed id predates the claim (it was for an
# earlier run of the job) and is dropped. Returns per started job: id, execution id, data, meta,
# origin, result_ttl ('' for a missing field).
CLAIM = (
    _LIB
    + """
local n, worker, now, now_text, queue_name = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local default_timeout, no_timeout_ttl, grace = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local settled = {finished = 1, failed = 1, started = 1, stopped = 1, canceled = 1, deferred = 1, scheduled = 1}
local out, longest = {}, 0
redis.call('SADD', KEYS[5], worker)
local function dead_letter(id, reason)
  redis.call('LREM', KEYS[2], 1, id)
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', 10000, '*', 'id', id, 'queue', queue_name, 'reason', reason,
             'worker', worker, 'at', ARGV[3])
end
for i = 1, n do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not id then break end
  redis.call('SREM', KEYS[7], id)
  local job = 'rq:job:' .. id
  if #id > 200 or not string.find(id, '^[%w_-]+$') then
    dead_letter(id, 'not a job id: RQ ids are letters, digits, _ and -')
  elseif redis.call('EXISTS', job) == 0 then
    dead_letter(id, 'no job hash under this id (deleted, or evicted by maxmemory)')
  else
    local f = redis.call('HMGET', job, 'data', 'meta', 'status', 'result_ttl', 'timeout')
    if f[3] and settled[f[3]] then
      redis.call('LREM', KEYS[2], 1, id)
    else
      local eid = ARGV[8 + i]
      local comp = id .. ':' .. eid
      local timeout = ttl_of(f[5], default_timeout)
      local ttl = timeout + grace
      if timeout < 0 then ttl = no_timeout_ttl end
      if ttl > longest then longest = ttl end
      redis.call('HSET', job, 'status', 'started', 'started_at', now_text, 'last_heartbeat', now_text,
                 'worker_name', worker, 'origin', queue_name)
      redis.call('PERSIST', job)
      redis.call('HSET', 'rq:execution:' .. comp, 'id', eid, 'job_id', id, 'created_at', now,
                 'last_heartbeat', now, 'worker_name', worker)
      redis.call('EXPIRE', 'rq:execution:' .. comp, ttl)
      redis.call('ZADD', 'rq:executions:' .. id, now + ttl + grace, eid)
      redis.call('EXPIRE', 'rq:executions:' .. id, ttl + grace)
      redis.call('ZADD', 'rq:wip:' .. queue_name, now + ttl, comp)
      redis.call('SADD', KEYS[3], comp)
      out[#out + 1] = {id, eid, f[1] or '', f[2] or '', queue_name, f[4] or ''}
    end
  end
end
if #out > 0 then
  redis.call('EXPIRE', KEYS[3], longest + grace)
  redis.call('HSET', KEYS[4], 'state', 'busy')
end
return out
"""
)

# KEYS: claims list, worker executions index, worker hash.
# ARGV: worker name, now (unix), now (RQ text), default failure ttl, notify TTL, then 8 per job:
#   id, execution id, origin, kind, value, result ttl, started (unix), notify key.
# kind 'ok': value is the return value (base64 JSON); 'fail': value is RQ's exc_string (base64
# zlib); 'retry': a transient failure, requeued at the back if the job has retries left, else
# failed with `value`; 'cancel': the engine aborted it on a cancel request (value as 'fail').
# A job canceled while it ran (its status reads 'canceled') stays canceled whatever its kind: no
# result, no retry, not counted as failed; a 'cancel' of a job not canceled fails it with
# `value`. A job no longer in this worker's claims list is skipped. Returns how many were settled.
SETTLE = (
    _LIB
    + """
local worker, now, now_text, default_ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local notify_ttl = tonumber(ARGV[5])
local ok, failed, canceled, worked = 0, 0, 0, 0
for i = 6, #ARGV, 8 do
  local id, eid, origin, kind, value = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local ttl, started, notify = ttl_of(ARGV[i + 5], 0), tonumber(ARGV[i + 6]), ARGV[i + 7]
  local job = 'rq:job:' .. id
  if redis.call('LREM', KEYS[1], 1, id) == 1 then
    forget_executions(id, origin, KEYS[2])
    local ended = true
    if redis.call('EXISTS', job) == 0 then
      ended = false
    elseif redis.call('HGET', job, 'status') == 'canceled' then
      canceled = canceled + 1
    elseif kind == 'ok' then
      redis.call('HSET', job, 'status', 'finished', 'ended_at', now_text)
      add_result(id, {'type', 1, 'worker_name', worker, 'return_value', value, 'execution_id', eid,
                      'execution_started_at', ARGV[i + 6], 'execution_ended_at', ARGV[2]}, ttl)
      if ttl == 0 then
        redis.call('DEL', job, 'rq:results:' .. id)
      else
        expire_job(id, ttl)
        redis.call('ZADD', 'rq:finished:' .. origin, registry_score(now, ttl), id)
      end
      ok = ok + 1
    elseif kind == 'retry' and retries_left(id) > 0 then
      requeue(id, origin, now_text, false, true)
      ended, failed = false, failed + 1
    else
      fail(id, origin, value, worker, eid, ARGV[i + 6], now, now_text, default_ttl)
      failed = failed + 1
    end
    if ended and notify ~= '' then
      redis.call('RPUSH', notify, id)
      redis.call('EXPIRE', notify, notify_ttl)
    end
    worked = worked + (now - (started or now))
  end
end
redis.call('HINCRBY', KEYS[3], 'successful_job_count', ok)
redis.call('HINCRBY', KEYS[3], 'failed_job_count', failed)
redis.call('HINCRBYFLOAT', KEYS[3], 'total_working_time', worked)
if redis.call('SCARD', KEYS[2]) == 0 then redis.call('HSET', KEYS[3], 'state', 'idle') end
return ok + failed + canceled
"""
)

# KEYS: a claims list, the executions index of the worker that held it, and optionally that
# worker's key: when given and present, the worker is alive (again) and nothing is done (-1).
# ARGV: now (unix), now (RQ text), spend ('1': the worker died holding these jobs, so a retry
# is spent), exc_string for a job out of retries (base64 zlib), worker name, default failure ttl,
# then the job ids to give back (none: every id in the list, and the list is deleted).
# Returns the jobs to their queues' heads in their claimed order: unstarted ones as they were,
# started ones with their execution records dropped (so RQ's started-registry cleanup never
# counts them as abandoned again), or failed once their retries are spent. A job canceled while its
# worker held it stays canceled; only its execution records go.
REQUEUE = (
    _LIB
    + """
local now, now_text, spend, exc, worker = tonumber(ARGV[1]), ARGV[2], ARGV[3] == '1', ARGV[4], ARGV[5]
local default_ttl = tonumber(ARGV[6])
if #KEYS > 2 and redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
local ids = {}
for i = 7, #ARGV do ids[#ids + 1] = ARGV[i] end
local whole = #ids == 0
if whole then ids = redis.call('LRANGE', KEYS[1], 0, -1) end
local handled = 0
for i = #ids, 1, -1 do
  local id = ids[i]
  local mine = whole or redis.call('LREM', KEYS[1], 1, id) == 1
  local f = redis.call('HMGET', 'rq:job:' .. id, 'status', 'origin')
  if mine and f[2] then
    if f[1] == 'queued' then
      push(f[2], id, true)
    elseif f[1] == 'canceled' then
      forget_executions(id, f[2], KEYS[2])
    elseif f[1] == 'started' then
      forget_executions(id, f[2], KEYS[2])
      if not spend then
        requeue(id, f[2], now_text, true, false)
      elseif retries_left(id) > 0 then
        requeue(id, f[2], now_text, true, true)
      else
        fail(id, f[2], exc, worker, '', '', now, now_text, default_ttl)
      end
    end
    handled = handled + 1
  end
end
if whole then redis.call('DEL', KEYS[1]) end
return handled
"""
)
