"""The Lua scripts behind `RQBridge`: every change a wicore worker makes to a job's RQ records is
one of these, run server-side, one call per batch.

Nothing read from a job hash is trusted: numbers go through `tonumber` with a default, a missing
field never reaches a string concatenation, and a job is settled only by a run (job id:execution
id) that the worker's claims set still holds (ZMSCORE finds it) and that is still the job's
current run (its hash's RUN_FIELD), so writing a result twice is a no-op, a job requeued by a
reaper is never also finished by the worker that lost it, and a canceled run's end never touches
the run of the same work submitted again. Records follow RQ 3.0's (job hash,
registries, executions, result stream); tests/test_rq_bridge.py reads them back with RQ.

Redis commands are the budget (docs/benchmarks.md, the queue benchmark): every command a script
runs counts, so per job a claim spends 6 (read the job, mark it started, its execution hash and
index with their TTLs) and a settle 5 (read status, mark it ended, the result entry and its TTL,
the job's TTL), plus 2 per distinct blob whose users its jobs leave (`ProducerConfig.release_blobs`). Whatever several jobs of a batch write to one key (registries, the claims set,
the worker's executions index, notification lists) or delete goes out once per batch (`defer`).
RQ's key prefixes come from RQ's classes (`wicore.rq_keys.LUA_PREAMBLE`: `RQ.job .. id`). The
scripts touch keys they compute (RQ's job hash of an id, ...): fine on one Redis, not on Redis Cluster
(README, "Past one Redis").
"""

from __future__ import annotations

from wicore import keys, rq_keys

# Helpers shared by the scripts below (Lua has no modules in EVAL: each script starts with these).
_LIB = (
    rq_keys.LUA_PREAMBLE
    + f"local RUN_FIELD, SUBMITTED = '{keys.RUN_FIELD}', '{keys.submitted('')}'\n"
    + f"local BLOB, BLOB_USERS, META_BLOBS = '{keys.blob('')}', '{keys.blob_users('')}', '{keys.META_BLOBS}'\n"
    + """
-- Writes gathered over a batch and sent once per command and key at `flush`, in first-use order
-- (a notification list's EXPIRE after its RPUSH). Members go out in slices of 1000 (Lua's unpack
-- has a stack limit); the slice is even, so ZADD's score/member pairs never split.
local deferred, deferred_order = {}, {}
local function call_many(cmd, key, items)
  local replies = {}
  for first = 1, #items, 1000 do
    local last = math.min(first + 999, #items)
    local reply
    if key then reply = redis.call(cmd, key, unpack(items, first, last))
    else reply = redis.call(cmd, unpack(items, first, last)) end
    if type(reply) == 'table' then
      for i = 1, last - first + 1 do replies[#replies + 1] = reply[i] end
    end
  end
  return replies
end
-- key: the command's key, or false for a multi-key command (DEL); a, b: what to add (b optional:
-- a ZADD member after its score, or a second key to DEL).
local function defer(cmd, key, a, b)
  local by_key = deferred[cmd]
  if not by_key then
    by_key = {}
    deferred[cmd] = by_key
  end
  local entry = by_key[key or '']
  if not entry then
    entry = {cmd = cmd, key = key, items = {}, n = 0}
    by_key[key or ''] = entry
    deferred_order[#deferred_order + 1] = entry
  end
  entry.items[entry.n + 1] = a
  entry.n = entry.n + 1
  if b ~= nil then
    entry.items[entry.n + 1] = b
    entry.n = entry.n + 1
  end
end
local function defer_once(cmd, key, value)
  if not (deferred[cmd] and deferred[cmd][key]) then defer(cmd, key, value) end
end
local function flush()
  for _, entry in ipairs(deferred_order) do call_many(entry.cmd, entry.key, entry.items) end
  deferred, deferred_order = {}, {}
end

-- Ended jobs leave the users of the blobs their meta names (`keys.BLOB_USERS`), gathered per blob
-- over a batch; `release_blobs`, before `flush`, removes them and deletes each blob left with no
-- user (in the flush's DEL). Removing an id twice is a no-op, so a job ended twice frees nothing twice.
local leaving, leaving_order = {}, {}
local function leave_blobs(id, meta)
  if type(meta) ~= 'string' or not string.find(meta, META_BLOBS, 1, true) then return end
  local ok, decoded = pcall(cjson.decode, meta)
  local shas = ok and type(decoded) == 'table' and decoded[META_BLOBS]
  if type(shas) ~= 'table' then return end
  for _, sha in ipairs(shas) do
    if type(sha) == 'string' and #sha == 64 and string.find(sha, '^%x+$') then
      if not leaving[sha] then
        leaving[sha] = {}
        leaving_order[#leaving_order + 1] = sha
      end
      leaving[sha][#leaving[sha] + 1] = id
    end
  end
end
local function release_blobs()
  for _, sha in ipairs(leaving_order) do
    call_many('SREM', BLOB_USERS .. sha, leaving[sha])
    if redis.call('EXISTS', BLOB_USERS .. sha) == 0 then defer('DEL', false, BLOB .. sha) end
  end
  leaving, leaving_order = {}, {}
end

local function forget_execution(id, eid, origin, worker_executions)
  local comp = id .. ':' .. eid
  defer('DEL', false, RQ.execution .. comp)
  defer('DEL', false, RQ.executions .. id)
  defer('ZREM', RQ.started .. origin, comp)
  defer('SREM', worker_executions, comp)
end

-- A run the job has moved on from (canceled and submitted again, or requeued and taken by
-- another worker): its own records go, the job's index keeps the current run.
local function forget_stale_run(id, eid, origin, worker_executions)
  local comp = id .. ':' .. eid
  defer('DEL', false, RQ.execution .. comp)
  redis.call('ZREM', RQ.executions .. id, eid)
  defer('ZREM', RQ.started .. origin, comp)
  defer('SREM', worker_executions, comp)
end

-- A claims set member: 'job id:execution id' (a run), or a bare job id (claimed by an earlier
-- wicore, execution unknown: eid is nil).
local function parse_run(member)
  local id, eid = string.match(member, '^([^:]+):(.+)$')
  if id then return id, eid end
  return member, nil
end

-- Every execution of a job, when its execution ids are not known (a dead worker's claims).
local function forget_executions(id, origin, worker_executions)
  local index = RQ.executions .. id
  for _, eid in ipairs(redis.call('ZRANGE', index, 0, -1)) do
    local comp = id .. ':' .. eid
    defer('DEL', false, RQ.execution .. comp)
    defer('ZREM', RQ.started .. origin, comp)
    defer('SREM', worker_executions, comp)
  end
  defer('DEL', false, index)
end

local function push(origin, id, front)
  local queue = RQ.queue .. origin
  if not redis.call('LPOS', queue, id) then
    if front then redis.call('LPUSH', queue, id) else redis.call('RPUSH', queue, id) end
  end
  redis.call('SADD', RQ.queues, queue)
end

-- A TTL as Redis takes it: an integer, -1 for "keep forever", `default` when unreadable; capped
-- at ten years (EXPIRE refuses what a huge or fractional number formats to).
local function ttl_of(value, default)
  local n = tonumber(value)
  if n == nil or n ~= n then return default end
  if n < 0 then return -1 end
  return math.min(math.floor(n), 315360000)
end

-- A job hash's retries_left field, read defensively.
local function retries_of(value)
  local n = tonumber(value)
  if n == nil or n ~= n or n < 1 then return 0 end
  return math.min(math.floor(n), 1000000)
end

-- `retries`: the job's retries_left, spent by one when `spend` (it failed, or its worker died
-- holding it).
local function requeue(id, origin, now_text, front, spend, retries)
  local job = RQ.job .. id
  if spend then
    redis.call('HSET', job, 'status', 'queued', 'enqueued_at', now_text, 'retries_left', retries - 1)
  else
    redis.call('HSET', job, 'status', 'queued', 'enqueued_at', now_text)
  end
  push(origin, id, front)
end

local function add_result(id, fields, ttl)
  local results = RQ.results .. id
  redis.call('XADD', results, 'MAXLEN', '~', 10, '*', unpack(fields))
  if ttl < 0 then redis.call('PERSIST', results) else redis.call('EXPIRE', results, ttl) end
end

local function expire_job(id, ttl)
  if ttl < 0 then redis.call('PERSIST', RQ.job .. id) else redis.call('EXPIRE', RQ.job .. id, ttl) end
end

local function registry_score(now, ttl)
  if ttl < 0 then return '+inf' end
  return now + ttl
end

local function fail(id, origin, exc, worker, eid, started, now, now_text, ttl)
  redis.call('HSET', RQ.job .. id, 'status', 'failed', 'ended_at', now_text)
  local fields = {'type', 2, 'worker_name', worker, 'exc_string', exc}
  if eid ~= '' then
    for _, v in ipairs({'execution_id', eid, 'execution_started_at', started, 'execution_ended_at', now}) do
      fields[#fields + 1] = v
    end
  end
  add_result(id, fields, ttl)
  expire_job(id, ttl)
  defer('ZADD', RQ.failed .. origin, registry_score(now, ttl), id)
  defer('DEL', false, SUBMITTED .. id)  -- resubmitting a failed job runs it again
end
"""
)

# KEYS: queue, claims set, worker executions index, worker hash, claimants set, dead-letter stream.
# ARGV: count, worker name, now (unix), now (RQ text), queue name, default job timeout, TTL of a
# job without timeout, TTL grace, then `count` fresh execution ids.
# Takes up to `count` jobs (one LPOP) and starts each as RQ's worker does (status, execution hash,
# the job's executions index, the started registry, the worker's executions index), naming the new
# execution the job's current run (RUN_FIELD); the claims set (a sorted set, scored in claim
# order) holds each started run (id:execution id). An id RQ could not have made, or one with no
# job hash, goes to the dead-letter stream; an id whose job is no longer queued (a duplicate entry,
# or a job canceled while its id sat in the queue) is dropped, never started. Returns per started
# job: id, execution id, data, meta, origin, result_ttl ('' for a missing field).
CLAIM = (
    _LIB
    + """
local n, worker, now, now_text, queue_name = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local default_timeout, no_timeout_ttl, grace = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local settled = {finished = 1, failed = 1, started = 1, stopped = 1, canceled = 1, deferred = 1, scheduled = 1}
local ids = redis.call('LPOP', KEYS[1], n)
if not ids then return {} end
local out, longest = {}, 0
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
local order = tonumber(last[2]) or 0
local function dead_letter(id, reason)
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', 10000, '*', 'id', id, 'queue', queue_name, 'reason', reason,
             'worker', worker, 'at', ARGV[3])
end
-- data, meta, status, result_ttl, timeout; nil when the key holds no RQ job hash.
local function read_job(id)
  local f = redis.pcall('HMGET', RQ.job .. id, 'data', 'meta', 'status', 'result_ttl', 'timeout', 'created_at')
  if f.err then return nil end
  for i = 1, 6 do if f[i] then return f end end
  return nil
end
local function start(id, eid, f)
  local comp = id .. ':' .. eid
  local timeout = ttl_of(f[5], default_timeout)
  local ttl = timeout + grace
  if timeout < 0 then ttl = no_timeout_ttl end
  if ttl > longest then longest = ttl end
  redis.call('HSET', RQ.job .. id, 'status', 'started', 'started_at', now_text, 'last_heartbeat', now_text,
             'worker_name', worker, 'origin', queue_name, RUN_FIELD, eid)
  redis.call('HSET', RQ.execution .. comp, 'id', eid, 'job_id', id, 'created_at', now,
             'last_heartbeat', now, 'worker_name', worker)
  redis.call('EXPIRE', RQ.execution .. comp, ttl)
  redis.call('ZADD', RQ.executions .. id, now + ttl + grace, eid)
  redis.call('EXPIRE', RQ.executions .. id, ttl + grace)
  defer('ZADD', RQ.started .. queue_name, now + ttl, comp)
  defer('SADD', KEYS[3], comp)
  order = order + 1
  defer('ZADD', KEYS[2], order, comp)
  out[#out + 1] = {id, eid, f[1] or '', f[2] or '', queue_name, f[4] or ''}
end
for i, id in ipairs(ids) do
  if #id > 200 or not string.find(id, '^[%w_-]+$') then
    dead_letter(id, 'not a job id: RQ ids are letters, digits, _ and -')
  else
    local f = read_job(id)
    if not f then
      dead_letter(id, 'no job hash under this id (deleted, evicted by maxmemory, or not a hash)')
    elseif not (f[3] and settled[f[3]]) then
      start(id, ARGV[8 + i], f)
    end
  end
end
flush()
if #out > 0 then
  redis.call('SADD', KEYS[5], worker)
  redis.call('EXPIRE', KEYS[3], longest + grace)
  redis.call('HSET', KEYS[4], 'state', 'busy')
end
return out
"""
)

# KEYS: claims set, worker executions index, worker hash.
# ARGV: worker name, now (unix), now (RQ text), default failure ttl, notify TTL, then 8 per job:
#   id, execution id, origin, kind, value, result ttl, started (unix), notify key.
# kind 'ok': value is the return value (base64 JSON); 'fail': value is RQ's exc_string (base64
# zlib); 'retry': a transient failure, requeued at the back if the job has retries left, else
# failed with `value`; 'cancel': the engine aborted it on a cancel request (value as 'fail').
# A job canceled while it ran (its status reads 'canceled') stays canceled whatever its kind: no
# result, no retry, not counted as failed; a 'cancel' of a job not canceled fails it with
# `value`. A run no longer in this worker's claims set is skipped; a run that is no longer its
# job's current one (RUN_FIELD: the job was canceled and submitted again, or requeued and taken
# again) leaves the job as it is and only drops its own records. A job that ends (not a retry)
# leaves the users of the blobs its meta names; a blob left with none is deleted. Returns how many
# jobs were settled.
SETTLE = (
    _LIB
    + """
local worker, now, now_text, default_ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local notify_ttl = tonumber(ARGV[5])
local ok, failed, canceled, worked = 0, 0, 0, 0
local runs = {}
for i = 6, #ARGV, 8 do runs[#runs + 1] = ARGV[i] .. ':' .. ARGV[i + 1] end
if #runs == 0 then return 0 end
local held = call_many('ZMSCORE', KEYS[1], runs)
local function settle(i)
  local id, eid, origin, kind, value = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local ttl, started, notify = ttl_of(ARGV[i + 5], 0), tonumber(ARGV[i + 6]), ARGV[i + 7]
  local job = RQ.job .. id
  defer('ZREM', KEYS[1], id .. ':' .. eid)
  worked = worked + (now - (started or now))
  local f = redis.call('HMGET', job, 'status', 'failure_ttl', 'retries_left', RUN_FIELD, 'meta')
  if f[4] ~= eid or not (f[1] == 'started' or f[1] == 'canceled') then  -- the job moved on (or is gone)
    forget_stale_run(id, eid, origin, KEYS[2])
    return
  end
  forget_execution(id, eid, origin, KEYS[2])
  if not (kind == 'retry' and f[1] == 'started' and retries_of(f[3]) > 0) then leave_blobs(id, f[5]) end
  if f[1] == 'canceled' then
    canceled = canceled + 1
  elseif kind == 'ok' then
    redis.call('HSET', job, 'status', 'finished', 'ended_at', now_text)
    add_result(id, {'type', 1, 'worker_name', worker, 'return_value', value, 'execution_id', eid,
                    'execution_started_at', ARGV[i + 6], 'execution_ended_at', ARGV[2]}, ttl)
    if ttl == 0 then
      defer('DEL', false, job, RQ.results .. id)
    else
      expire_job(id, ttl)
      defer('ZADD', RQ.finished .. origin, registry_score(now, ttl), id)
    end
    ok = ok + 1
  elseif kind == 'retry' and retries_of(f[3]) > 0 then
    requeue(id, origin, now_text, false, true, retries_of(f[3]))
    failed = failed + 1
    return
  else
    fail(id, origin, value, worker, eid, ARGV[i + 6], now, now_text, ttl_of(f[2], default_ttl))
    failed = failed + 1
  end
  if notify ~= '' then
    defer('RPUSH', notify, id)
    defer_once('EXPIRE', notify, notify_ttl)
  end
end
local settled = {}
for j = 1, #runs do
  if held[j] and not settled[runs[j]] then  -- a run given twice is settled once
    settled[runs[j]] = true
    settle(6 + (j - 1) * 8)
  end
end
release_blobs()
flush()
if ok > 0 then redis.call('HINCRBY', KEYS[3], 'successful_job_count', ok) end
if failed > 0 then redis.call('HINCRBY', KEYS[3], 'failed_job_count', failed) end
redis.call('HINCRBYFLOAT', KEYS[3], 'total_working_time', worked)
if redis.call('ZCARD', KEYS[1]) == 0 then redis.call('HSET', KEYS[3], 'state', 'idle') end
return ok + failed + canceled
"""
)

# KEYS: a claims set, the executions index of the worker that held it, and optionally that
# worker's key: when given and present, the worker is alive (again) and nothing is done (-1).
# ARGV: now (unix), now (RQ text), spend ('1': the worker died holding these jobs, so a retry
# is spent), exc_string for a job out of retries (base64 zlib), worker name, default failure ttl,
# then the runs to give back (none: every run in the set, and the set is deleted; bare job ids,
# and a claims list, as a worker of an earlier wicore kept them, are read too).
# Returns the jobs to their queues' heads in their claimed order: unstarted ones as they were,
# started ones with their execution records dropped (so RQ's started-registry cleanup never
# counts them as abandoned again), or failed once their retries are spent. A job canceled while its
# worker held it stays canceled; only its execution records go. A run that is no longer its job's
# current one (RUN_FIELD) leaves the job as it is: only the run's own records go.
REQUEUE = (
    _LIB
    + """
local now, now_text, spend, exc, worker = tonumber(ARGV[1]), ARGV[2], ARGV[3] == '1', ARGV[4], ARGV[5]
local default_ttl = tonumber(ARGV[6])
if #KEYS > 2 and redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
local members = {}
for i = 7, #ARGV do members[#members + 1] = ARGV[i] end
local whole = #members == 0
if whole and redis.call('TYPE', KEYS[1])['ok'] == 'list' then
  members = redis.call('LRANGE', KEYS[1], 0, -1)
elseif whole then
  members = redis.call('ZRANGE', KEYS[1], 0, -1)
end
local handled = 0
for i = #members, 1, -1 do
  local id, eid = parse_run(members[i])
  local mine = whole or redis.call('ZREM', KEYS[1], members[i]) == 1
  local f = redis.call('HMGET', RQ.job .. id, 'status', 'origin', 'failure_ttl', 'retries_left', RUN_FIELD, 'meta')
  if mine and f[2] then
    if eid and f[5] ~= eid then
      forget_stale_run(id, eid, f[2], KEYS[2])
    elseif f[1] == 'queued' then
      push(f[2], id, true)
    elseif f[1] == 'canceled' then
      forget_executions(id, f[2], KEYS[2])
      leave_blobs(id, f[6])
    elseif f[1] == 'started' then
      forget_executions(id, f[2], KEYS[2])
      if not spend then
        requeue(id, f[2], now_text, true, false, 0)
      elseif retries_of(f[4]) > 0 then
        requeue(id, f[2], now_text, true, true, retries_of(f[4]))
      else
        fail(id, f[2], exc, worker, '', '', now, now_text, ttl_of(f[3], default_ttl))
        leave_blobs(id, f[6])
      end
    end
    handled = handled + 1
  end
end
if whole then redis.call('DEL', KEYS[1]) end
release_blobs()
flush()
return handled
"""
)
