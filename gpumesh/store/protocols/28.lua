#!lua name=gpumesh_c8c00f5014f4
-- Helpers shared by every gpumesh script, defined once at the top of the library by gpumesh/store/scripts.py
-- (not a script of its own).
-- Time always comes from the server; workers' clocks never enter the state machine.
--
-- The contract every script keeps:
--  * KEYS and ARGV are named once, in a block of locals at the top of the script, under a header
--    comment listing them in order (as dramatiq's dispatch.lua does); nothing below that block
--    indexes KEYS or ARGV.
--  * One reply shape: {ok, status, field, value, field, value, ...}
--      ok      1: the call did what it asks for; 0: it was refused, or found nothing to do
--      status  ok = 1: the task's status now (or what the call did); ok = 0: why not
--      then    named results as field/value pairs (none is fine), read by name in scripts.py
--    A lease is such a reply: {1, 'running', 'task_id', id, 'attempt', n, ...} (lease_reply below).
--  * Lease tokens are made by the worker that takes the task, passed in, and never stored: Redis keeps
--    digest(token) in the lease key and the task's lease, backup and done_token fields, and a holder
--    proves itself by presenting the token, which the script digests (see holder below).
--  * A helper needing more than four values takes one table of named fields instead.
-- This file runs once, when the library loads (scripts.py puts it at the library's top): the functions
-- reach these helpers as upvalues, so nothing here may change after loading (no helper keeps state, no
-- table here is written), and only what scripts share lives here. Lua 5.1 allows a function 60 upvalues:
-- keep the names defined here below that.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function secs(ms)
  return string.format('%.3f', ms / 1000)
end

-- What is stored of a lease token (gpumesh/store/scripts.py's token_digest computes the same).
local function digest(token)
  return redis.sha1hex(token)
end

-- What a done task keeps of the token that completed it (complete.lua: a repeat of that call is recognised):
-- 64 bits of its digest are as hard to guess as the whole, and a million done tasks keep 24 bytes less each.
local function done_token(token)
  return string.sub(digest(token), 1, 16)
end

local function emit(events_key, kind, id, status)
  redis.call('XADD', events_key, 'MAXLEN', '~', 10000, '*', 'kind', kind, 'id', id, 'status', status)
end

-- A task ended (done, failed or cancelled): one entry on its job's stream of ends, which Job.as_completed
-- reads (keys.job_ended, beside the job's hash). Uncapped: one entry per end, and a task ends again only
-- after a retry; it goes with the job.
local function ended(job_key, task_id, status)
  redis.call('XADD', job_key .. ':ended', '*', 'task', task_id, 'status', status)
end

-- Add to a job's counter; the counter's new value. Any credential that writes jobs can write a counter
-- that is not a number (HINCRBY would raise, and the script with it): such a counter restarts from this
-- change.
local function incr(key, field, by, float)
  local r = redis.pcall(float and 'HINCRBYFLOAT' or 'HINCRBY', key, field, by)
  if type(r) == 'table' and r.err then
    redis.pcall('HSET', key, field, math.max(by, 0))
    return math.max(by, 0)
  end
  return tonumber(r)
end

-- Move one task between job counters, in the same script as the task's own change; what is left in
-- ``from``.
local function move(job_key, from, to)
  local left = incr(job_key, from, -1)
  incr(job_key, to, 1)
  return left
end

-- The last task to end sets the job's terminal status: cancelled > failed > done.
local function maybe_finish(job_key, events_key, job_id, ms)
  local c = redis.call('HMGET', job_key, 'queued', 'running', 'failed', 'cancelled', 'status')
  local queued, running, failed, cancelled, was = c[1], c[2], c[3], c[4], c[5]
  if (tonumber(queued) or 0) > 0 or (tonumber(running) or 0) > 0 then
    return
  end
  local status = 'done'
  if (tonumber(cancelled) or 0) > 0 then
    status = 'cancelled'
  elseif (tonumber(failed) or 0) > 0 then
    status = 'failed'
  end
  if was ~= status then
    redis.call('HSET', job_key, 'status', status, 'finished_at', secs(ms))
    emit(events_key, 'job', job_id, status)
  end
end

-- Names built here, not in KEYS: the dispatcher cannot know which job's queue it will take from before
-- it looks (as dramatiq's dispatch.lua builds its queue keys). They mirror gpumesh/store/keys.py exactly.
local PREFIX = 'gpumesh:'

local function job_of(task_id)
  return string.match(task_id, '^(.*)%-%d+$')
end

local function pending_key(job_id, klass)
  return PREFIX .. 'job:' .. job_id .. ':pending:' .. klass
end

local function pad(index)
  return string.format('%08d', tonumber(index))
end

-- Work arrived: every worker that found nothing at its last dispatch gets a token on its wake list
-- (it blocks there), and the idle set empties. Waking one that still cannot run anything costs one
-- dispatch; missing one would leave it asleep until its poll timeout.
local function wake_idle(idle_key)
  local idle = redis.call('SMEMBERS', idle_key)
  for _, w in ipairs(idle) do
    local k = PREFIX .. 'wake:' .. w
    redis.call('RPUSH', k, '1')
    redis.call('LTRIM', k, -1, -1)
    redis.call('PEXPIRE', k, 60000)
  end
  if #idle > 0 then
    redis.call('DEL', idle_key)
  end
end

-- A task becomes takeable: into its job's pending zset of its requirement class, the job into the ready
-- index at its priority, idle workers woken.
-- a: {task_key, job_key, ready_key, idle_key, job_id}
local function make_pending(a)
  local t = redis.call('HMGET', a.task_key, 'index', 'cost', 'class')
  local index, cost, klass = t[1], tonumber(t[2] or 1) or 1, t[3] or '0'
  redis.call('ZADD', pending_key(a.job_id, klass), cost, pad(index))
  local priority = tonumber(redis.call('HGET', a.job_key, 'priority') or 0) or 0
  redis.call('ZADD', a.ready_key, priority, a.job_id .. '/' .. klass)
  incr(a.job_key, 'pending_cost', cost, true)
  wake_idle(a.idle_key)
end

-- A queued task leaves its pending zset (taken, or cancelled); the ready index drops a drained class.
-- a: {task_key, job_key, ready_key, job_id, and optionally index, cost, klass: the task's fields when
-- the caller has them already (else read here); remains: the caller saw another member in the set}
local function unpend(a)
  local index, cost, klass = a.index, a.cost, a.klass
  if index == nil then
    local t = redis.call('HMGET', a.task_key, 'index', 'cost', 'class')
    index, cost, klass = t[1], tonumber(t[2] or 1) or 1, t[3] or '0'
  end
  local pk = pending_key(a.job_id, klass)
  if redis.call('ZREM', pk, pad(index)) == 1 then
    incr(a.job_key, 'pending_cost', -cost, true)
  end
  if not a.remains and redis.call('EXISTS', pk) == 0 then
    redis.call('ZREM', a.ready_key, a.job_id .. '/' .. klass)
  end
end

-- The lease reply: everything a worker needs to run the task, as field/value pairs (the names are the
-- attributes of scripts.py's Lease, but for the token: the caller made it and keeps it). l: those fields;
-- signature, key_id and expires_at may be missing, and
-- fleet_version (dispatch) or backup and backup_mode (speculate: a backup copy) are added when present.
local function lease_reply(l)
  local r = {1, 'running',
    'task_id', l.task_id,
    'attempt', l.attempt,
    'job_id', l.job_id,
    'index', l.index,
    'payload', l.payload,
    'script_sha', l.script_sha,
    'script_name', l.script_name,
    'timeout', l.timeout,
    'max_attempts', l.max_attempts,
    'signature', l.signature or '',
    'key_id', l.key_id or '',
    'expires_at', l.expires_at or '0',
    'server_ms', l.server_ms}
  local n = 28  -- #r, counted here (a missing value would leave a hole)
  if l.signature and l.signature ~= '' then
    -- Whether its job's spent set (signing.py) is there and holds it, read with the lease: a trusting worker
    -- refuses a task that ended for good (executor._refusal) without another round trip.
    local index = string.match(l.task_id, '%-(%d+)$') or ''
    local got = redis.pcall('SMISMEMBER', PREFIX .. 'spent:' .. (job_of(l.task_id) or ''), '*', index)
    local state = 'missing'
    if type(got) == 'table' and not got.err and got[1] == 1 then
      state = got[2] == 1 and 'ended' or 'open'
    end
    r[n + 1], r[n + 2] = 'spent', state
    n = n + 2
  end
  if l.fleet_version then
    r[n + 1], r[n + 2] = 'fleet_version', l.fleet_version
    n = n + 2
  end
  if l.backup then
    r[n + 1], r[n + 2], r[n + 3], r[n + 4] = 'backup', 1, 'backup_mode', l.backup_mode
  end
  return r
end

-- The task fields take() needs, read in one call (status first, so callers can check it).
local TAKE_TASK = {'status', 'attempts', 'index', 'payload', 'sig'}
-- The job fields take() needs; dispatch reads them with what it chooses by, in one call.
local TAKE_JOB = {'status', 'id', 'script_sha', 'script_name', 'timeout', 'key_id', 'expires_at', 'max_attempts'}

-- queued -> running: the lease, the counters, the worker's current task. Returns lease_reply.
-- a: {task_key, lease_key, leases_key, job_key, events_key, worker_key, task_id, worker_id, ttl_ms, ms,
--     token: the lease token the worker made (only its digest is stored),
--     task: the HMGET of TAKE_TASK of the task,
--     job: an HMGET holding TAKE_JOB of its job from position job_from + 1 (job_from: 0 if nil), or nil
--          to read it here,
--     worker_known: the worker hash exists (else checked here),
--     fleet_version: passed on to lease_reply}
local function take(a)
  local ms, ttl_ms, task_id, worker_id = a.ms, a.ttl_ms, a.task_id, a.worker_id
  local t = a.task
  local attempt, index, payload, signature = (tonumber(t[2]) or 0) + 1, t[3], t[4], t[5]
  local token = digest(a.token)
  redis.call('SET', a.lease_key, token, 'PX', ttl_ms)
  redis.call('ZADD', a.leases_key, ms + ttl_ms, task_id)
  redis.call('HSET', a.task_key, 'status', 'running', 'attempts', attempt, 'worker', worker_id, 'lease', token,
    'started_at', secs(ms), 'promoted', '')
  if attempt == 1 then
    -- Where its lines begin in its job's log (gpumesh/store/tasklog.py): kept through a retry, whose attempts
    -- count again from 1, so that the task's log reads from its first attempt.
    redis.call('HSETNX', a.task_key, 'log_from', ms)
  end
  move(a.job_key, 'queued', 'running')
  local job, j = a.job, a.job_from or 0
  if not job then
    job, j = redis.call('HMGET', a.job_key, unpack(TAKE_JOB)), 0
  end
  if job[j + 1] == 'queued' then  -- the job's status
    redis.call('HSET', a.job_key, 'status', 'running', 'started_at', secs(ms))
  end
  if a.worker_known or redis.call('EXISTS', a.worker_key) == 1 then
    redis.call('HSET', a.worker_key, 'current_task', task_id)
  end
  emit(a.events_key, 'task', task_id, 'running')
  return lease_reply({
    task_id = task_id, attempt = attempt, job_id = job[j + 2], index = index, payload = payload,
    script_sha = job[j + 3], script_name = job[j + 4], timeout = job[j + 5], key_id = job[j + 6],
    expires_at = job[j + 7], max_attempts = job[j + 8], signature = signature, server_ms = ms,
    fleet_version = a.fleet_version,
  })
end

-- End a running attempt: back to 'queued' (pending again, idle workers woken) while attempts remain,
-- else 'failed'. Returns the reply {1, 'queued' | 'failed', 'attempts', attempts spent}.
-- a: {task_key, job_key, events_key, ready_key, idle_key, stats_key, task_id, error ('' for none),
--     duration (s, stored when it fails), ms,
--     refund: the attempt does not count (a worker handing its task back on shutdown),
--     final: fail for good whatever attempts remain}
-- Failure kinds (gpumesh/models.py FAILURE_KINDS): 'script' (non-zero exit, a traceback, no usable
-- result), 'timeout', 'memory' (over its memory cap, out of CUDA memory), 'lost' (its worker or lease was
-- lost, its outputs could not be stored), 'refused' (it must not run: never retried).
-- A job's 'retry_on' (comma-separated kinds) says which kinds are retried while attempts remain; a job
-- without one (written before it existed) retries every kind but 'refused'.
local function retried(job_key, kind)
  if kind == 'refused' then
    return false
  end
  local on = redis.pcall('HGET', job_key, 'retry_on')
  if type(on) ~= 'string' then
    return true
  end
  return string.find(',' .. on .. ',', ',' .. kind .. ',', 1, true) ~= nil
end

-- A lost attempt (worker or lease lost) is retried without spending one of max_attempts this many times
-- (the task's 'lost' counts them); past that, lost attempts spend attempts as any other (a task that
-- takes its worker down each time). The task's 'attempts' still counts every run.
local FREE_LOST = 3

-- An attempt ended without a result: back to queued (attempts left, and its kind retried) or failed.
-- a.kind: the failure kind (above); a.refund: hand it back without spending its attempt (a worker that
-- stops); a.final: fail it for good whatever attempts remain; a.free: a lost attempt (the reaper found its
-- lease lapsed), free up to FREE_LOST times.
-- Reply: {1, 'queued' | 'failed', 'attempts', attempts spent, 'kind', kind}, and on 'failed'
-- 'not_retried' 1 when attempts remained but its kind is not retried (0 otherwise).
local function end_attempt(a)
  local task_key, job_key = a.task_key, a.job_key
  local kind = a.kind or 'script'
  local attempts = tonumber(redis.call('HGET', task_key, 'attempts') or 0)
  local max_attempts = tonumber(redis.call('HGET', job_key, 'max_attempts') or 1)
  local job_id = job_of(a.task_id)
  local final = a.final or (not a.refund and not retried(job_key, kind))
  if a.refund then
    attempts = redis.pcall('HINCRBY', task_key, 'attempts', -1)
    if type(attempts) ~= 'number' then  -- not a number (written by some credential): start the count again
      attempts = 0
      redis.pcall('HSET', task_key, 'attempts', 0)
    end
  end
  -- attempts counts runs (each has its own number); the first FREE_LOST lost ones are not spent
  local lost = a.free and not a.refund and redis.pcall('HINCRBY', task_key, 'lost', 1)
  if type(lost) ~= 'number' then
    lost = tonumber(redis.pcall('HGET', task_key, 'lost')) or 0
  end
  attempts = attempts - math.min(lost, FREE_LOST)
  redis.call('HSET', task_key, 'error_kind', kind)
  if a.error ~= '' then
    redis.call('HSET', task_key, 'error', a.error)
  end
  if not a.refund then
    incr(a.stats_key, 'attempts_failed:' .. kind, 1)
  end
  if attempts < max_attempts and not final then
    redis.call('HSET', task_key, 'status', 'queued', 'lease', '')
    move(job_key, 'running', 'queued')
    make_pending({task_key = task_key, job_key = job_key, ready_key = a.ready_key, idle_key = a.idle_key,
      job_id = job_id})
    if not a.refund then
      incr(a.stats_key, 'retried', 1)
    end
    emit(a.events_key, 'task', a.task_id, 'queued')
    return {1, 'queued', 'attempts', attempts, 'kind', kind}
  end
  redis.call('HSET', task_key, 'status', 'failed', 'lease', '', 'finished_at', secs(a.ms), 'duration', a.duration)
  move(job_key, 'running', 'failed')
  incr(job_key, 'failed:' .. kind, 1)  -- failed tasks by kind, for status (retry.lua takes one back)
  incr(a.stats_key, 'failed', 1)
  emit(a.events_key, 'task', a.task_id, 'failed')
  ended(job_key, a.task_id, 'failed')
  -- The first tasks to fail, for status and submit --wait to say why (keys.job_failed)
  if redis.call('RPUSH', job_key .. ':failed', a.task_id) > 100 then
    redis.call('LTRIM', job_key .. ':failed', 0, 99)
  end
  maybe_finish(job_key, a.events_key, job_id, a.ms)
  local stopped = attempts < max_attempts and not a.final and 1 or 0
  return {1, 'failed', 'attempts', attempts, 'kind', kind, 'not_retried', stopped}
end

-- Whether a worker runs a job signed by key_id ('' or nil: unsigned). A worker started with --trust
-- publishes the resource 'trusts' (the ids of its keys, comma-separated) and runs only tasks signed by
-- one of them; any other worker runs every task. res: the worker's resources (decoded), or nil.
local function accepts_signer(res, key_id)
  local trusts = res and res['trusts']
  if not trusts or trusts == '' then
    return true
  end
  if not key_id or key_id == '' then
    return false
  end
  return string.find(',' .. trusts .. ',', ',' .. key_id .. ',', 1, true) ~= nil
end

-- Whether a worker's lender lets it run a job (gpumesh worker --max-task-hours, --accept-from): the job's
-- timeout (s) within max_task_hours, and the credential that submitted it ('submitter', recorded at submit)
-- among accept_from (comma-separated). A job that recorded no submitter runs on no worker with accept_from.
-- res: the worker's resources (decoded), or nil.
local function lender_accepts(res, timeout, submitter)
  if type(res) ~= 'table' then
    return true
  end
  local hours = tonumber(res['max_task_hours'])
  if hours and (tonumber(timeout) or math.huge) > hours * 3600 then
    return false
  end
  local from = res['accept_from']
  if type(from) == 'string' and from ~= '' then
    if type(submitter) ~= 'string' or submitter == '' or string.find(submitter, ',', 1, true) then
      return false
    end
    return string.find(',' .. from .. ',', ',' .. submitter .. ',', 1, true) ~= nil
  end
  return true
end

-- Requirements (gpumesh/requirements.py has the same rules, tested against the same table).
-- reqs: list of {key, op, value}; res: the worker's resources (strings and numbers).
-- A decimal number or nil, as requirements.py reads one (strtod alone would take 'inf', 'nan', hex).
-- At most MAX_DECIMAL characters: the pattern backtracks in quadratic time, and resources and task
-- fields are written by worker credentials (30,000 digits held Redis for 10 s).
local MAX_DECIMAL = 40
local function decimal(text)
  if #text <= MAX_DECIMAL and string.find(text, '^%s*[-+]?[%d%.]+[eE]?[-+]?%d*%s*$') then
    return tonumber(text)
  end
  return nil
end

local function meets(req, res)
  local have = res[req[1]]
  local op, want = req[2], req[3]
  if have == nil or have == cjson.null then
    return op == '!='
  end
  local text = tostring(have)
  if op == '>=' or op == '<=' then
    local x, w = decimal(text), decimal(want)
    if x == nil or w == nil then
      return false
    end
    if op == '>=' then return x >= w end
    return x <= w
  end
  if op == '~' then
    return string.find(string.lower(text), string.lower(want), 1, true) ~= nil
  end
  local a, b = decimal(text), decimal(want)
  local equal
  if a ~= nil and b ~= nil then
    equal = a == b
  else
    equal = string.lower(text) == string.lower(want)
  end
  if op == '=' then return equal end
  return not equal
end

local function meets_all(reqs, res)
  for _, req in ipairs(reqs) do
    if not meets(req, res) then
      return false
    end
  end
  return true
end

-- The registered fleet's size and strength, recounted only after a worker joined or left (the
-- dispatcher must not walk a thousand workers per task). Returns n, score sum, score max, version.
local function fleet(scores_key, fleet_key)
  local f = redis.call('HMGET', fleet_key, 'n', 'sum', 'max', 'dirty', 'v')
  local count, total, strongest, dirty, version = tonumber(f[1]), tonumber(f[2]), tonumber(f[3]), f[4], f[5] or '0'
  if count and total and strongest and dirty ~= '1' then  -- else recount (never yet counted, or not numbers)
    return count, total, strongest, version
  end
  local all = redis.call('ZRANGE', scores_key, 0, -1, 'WITHSCORES')
  local n, sum, max = 0, 0, 0
  for i = 2, #all, 2 do
    local s = tonumber(all[i])
    n = n + 1
    sum = sum + s
    if s > max then max = s end
  end
  redis.call('HSET', fleet_key, 'n', n, 'sum', sum, 'max', max, 'dirty', 0)
  return n, sum, max, version
end

-- Upper bounds (s) of the task duration histogram; gpumesh/server/metrics.py reads the same list.
local DURATION_BUCKETS = {0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 3600}

local function observe_duration(hist_key, seconds)
  local label = '+Inf'
  for _, le in ipairs(DURATION_BUCKETS) do
    if seconds <= le then
      label = tostring(le)
      break
    end
  end
  incr(hist_key, label, 1)
  incr(hist_key, 'sum', seconds, true)
  incr(hist_key, 'count', 1)
end

-- Speculation: a running task may have one backup copy on a stronger idle worker (speculate.lua).
-- The lease fence of complete and fail: which copy `token` (the plain token the caller presents) holds,
-- 'primary' or 'backup', then nil, then whether the task has a backup copy (speculate.lua sets and
-- clear_backup clears its fields together); or nil and the refusal reply {0, why}, why = 'missing', the
-- task's status, or 'stale' (another lease holds it now, or no token).
-- ``more``: further fields of the task to read in the same call, returned as a fourth value after
-- status, lease and backup (so from position 4).
local function holder(task_key, token, more)
  if token == '' then
    return nil, {0, 'stale'}
  end
  token = digest(token)
  local t = redis.call('HMGET', task_key, 'status', 'lease', 'backup', unpack(more or {}))
  local status, lease, backup = t[1], t[2], t[3]
  if not status then
    return nil, {0, 'missing'}
  end
  if status ~= 'running' then
    return nil, {0, status}
  end
  local has_backup = type(backup) == 'string' and backup ~= ''  -- a field never written reads as false
  if lease == token then
    return 'primary', nil, has_backup, t
  end
  if has_backup and backup == token then
    return 'backup', nil, true, t
  end
  return nil, {0, 'stale'}
end

local function clear_backup(task_key)
  redis.call('HSET', task_key, 'backup', '', 'backup_worker', '', 'backup_until', 0)
end

-- The history of attempts, which the dashboard's timeline draws: one entry per attempt that ended, on its
-- job's stream of attempts (keys.job_attempts; the running ones are read from the tasks). attempt_of reads
-- a copy's fields before the caller changes them ('primary' or 'backup'; nil when there is no such copy);
-- attempt_log writes the entry: outcome done, failed, retried, lost, cancelled, superseded or handed back,
-- with the failure kind when there is one. Capped: a job keeps its last 50,000 attempts.
-- attempt_rec builds the record from those fields already read: t[at + 1] ... t[at + 5], in the order
-- ATTEMPT_FIELDS gives for the copy.
local ATTEMPT_FIELDS = {
  primary = {'index', 'attempts', 'worker', 'started_at', 'promoted'},
  backup = {'index', 'attempts', 'backup_worker', 'backup_started_at', 'backup_until'},
}
local function attempt_rec(copy, t, at)
  local worker = t[at + 3]
  if not worker or worker == '' then
    return nil
  end
  local last = t[at + 5]
  return {index = t[at + 1], attempt = t[at + 2], worker = worker, started = t[at + 4] or '',
    backup = copy == 'backup' or (last or '') ~= '', until_ms = copy == 'backup' and tonumber(last or 0) or nil}
end
local function attempt_of(task_key, copy)
  copy = copy == 'backup' and 'backup' or 'primary'
  return attempt_rec(copy, redis.call('HMGET', task_key, unpack(ATTEMPT_FIELDS[copy])), 0)
end

local function attempt_log(job_key, rec, outcome, kind, ms)
  if not rec then
    return
  end
  if rec.until_ms and rec.until_ms > 0 and rec.until_ms < ms then  -- a backup whose lease lapsed before
    ms, outcome, kind = rec.until_ms, 'lost', 'lost'
  end
  redis.pcall('XADD', job_key .. ':attempts', 'MAXLEN', '~', 50000, '*', 'index', rec.index or '',
    'attempt', rec.attempt or '', 'worker', rec.worker, 'copy', rec.backup and 'backup' or 'primary',
    'started', rec.started, 'ended', secs(ms), 'outcome', outcome, 'kind', kind or '')
end

-- The primary copy ended without a result (failed, handed back, or its lease lapsed): a live backup
-- becomes the primary, with the rest of its lease, and the task keeps running. Returns true if so.
-- a: {task_key, lease_key, leases_key, task_id, ms}
local function promote_backup(a)
  local b = redis.call('HMGET', a.task_key, 'backup', 'backup_worker', 'backup_until')
  local token, worker, until_ms = b[1], b[2], tonumber(b[3] or 0) or 0
  if not token or token == '' or until_ms <= a.ms then
    return false
  end
  local started = redis.call('HGET', a.task_key, 'backup_started_at') or ''
  redis.call('HSET', a.task_key, 'lease', token, 'worker', worker, 'started_at', started, 'promoted', '1')
  clear_backup(a.task_key)
  redis.call('SET', a.lease_key, token, 'PX', until_ms - a.ms)
  redis.call('ZADD', a.leases_key, until_ms, a.task_id)
  return true
end

local function clear_current(worker_key, task_id)
  if redis.call('HGET', worker_key, 'current_task') == task_id then
    redis.call('HSET', worker_key, 'current_task', '')
  end
end

redis.register_function{function_name='gpumesh_c8c00f5014f4_dispatch', callback=function(KEYS, ARGV)
-- dispatch: give this worker the task it should run now, decided against the live fleet, or nothing.
-- Late binding: nothing about placement is fixed at submit. In one atomic step:
--  1. jobs: the highest priority with a queued task whose requirements this worker meets; among
--     jobs of that priority, the one with the fewest running tasks, then the least queued work (a small job
--     goes first even where every job runs nothing at the moment of asking: a worker alone), then the
--     oldest: fair share;
--  2. the task, by cost, from that job's queued tasks: a worker alone takes the lightest (its makespan
--     is the same in any order, and heavy tasks stay for stronger workers that may join); otherwise
--     the heaviest it can finish within the horizon, i.e. cost <= score * max(W / S, c_max / s_max)
--     (W the job's queued cost, S the fleet's total score), so the strongest takes the heaviest and
--     weaker workers lighter ones (a worker weaker than the strongest leaves the heaviest cost to it
--     while a lighter task is there); when even the lightest is beyond its horizon it takes the lightest
--     (no worker idles while work it may run waits; a backup copy can rescue a straggler);
--  3. lease it (as acquire.lua). Finding nothing, the worker joins the idle set, woken when work arrives.
-- A task whose last attempt failed on this worker (fail.lua's 'avoid', until 'avoid_until'), or that ran
-- out of memory and waits for a live worker with more ('bigger'), is left to the other live workers meanwhile: the next task of its job instead, or another job, or nothing (this
-- worker asks again within a heartbeat interval, and takes it once the time is up).
--
-- dispatch(
--   keys = {ready zset, scores zset, fleet hash, worker hash, leases zset, events stream, idle set},
--   args = {worker id, lease TTL (ms), this worker's score,
--           the lease token to hold what it takes (made by the worker; only its digest is stored)}
-- )
-- Reply (see _lib.lua): the lease (lease_reply) with 'fleet_version', the registered fleet's version,
-- appended; or {0, 'idle', 'fleet_version', version} when there is nothing it may run.
--
-- Nothing written into a job or task may make this script raise (every worker would fail its dispatch,
-- and the mesh would stall): any credential that writes jobs and tasks can write garbage there. A ready
-- entry whose job is unreadable (not a hash, requirement classes that are not JSON, a pending set that
-- is not a zset) leaves the ready index; a pending member that is not a task index leaves its pending
-- set; a queued task whose fields (or its job's) the worker could not run by is failed with the reason,
-- never leased. Other jobs go on being dispatched.

local ready_key = KEYS[1]
local scores_key = KEYS[2]
local fleet_key = KEYS[3]
local worker_key = KEYS[4]
local leases_key = KEYS[5]
local events_key = KEYS[6]
local idle_key = KEYS[7]

local worker_id = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local score = tonumber(ARGV[3])
local token = ARGV[4]

local n, sum, max, version = fleet(scores_key, fleet_key)

-- The same call again (redis-py sends a command again when the link failed before its reply came, though
-- this script may have run): the task this worker holds under this very token, made for this call, is the
-- answer again, not a second task left leased to a worker that never heard of it.
do
  local held = redis.pcall('HGET', worker_key, 'current_task')
  if type(held) == 'string' and held ~= '' then
    local t = redis.pcall('HMGET', PREFIX .. 'task:' .. held, 'status', 'lease', 'worker', 'attempts', 'index',
      'payload', 'sig')
    if type(t) == 'table' and not t.err and t[1] == 'running' and t[2] == digest(token) and t[3] == worker_id then
      local job = redis.pcall('HMGET', PREFIX .. 'job:' .. (job_of(held) or ''), unpack(TAKE_JOB))
      if type(job) == 'table' and not job.err and job[2] then
        return lease_reply({
          task_id = held, attempt = tonumber(t[4]) or 1, job_id = job[2], index = t[5], payload = t[6],
          script_sha = job[3], script_name = job[4], timeout = job[5], key_id = job[6], expires_at = job[7],
          max_attempts = job[8], signature = t[7], server_ms = now_ms(), fleet_version = version,
        })
      end
    end
  end
end

-- Nothing it may run: the worker joins the idle set (woken when work arrives), and its registration names
-- no task any more. A worker asks only when it runs nothing, and a cancelled task's worker never completes
-- or fails it, so this is where that task leaves its `current_task` (what `workers` and the dashboard show).
local function go_idle()
  redis.call('SADD', idle_key, worker_id)
  local current = redis.pcall('HGET', worker_key, 'current_task')  -- pcall: not a hash must not stop dispatch
  if type(current) == 'string' and current ~= '' then
    redis.pcall('HSET', worker_key, 'current_task', '')
  end
  return {0, 'idle', 'fleet_version', version}
end
local raw = redis.pcall('HGET', worker_key, 'resources')
if type(raw) ~= 'string' then
  raw = nil  -- none, or not a hash
end
local resources  -- decoded only when some queued work has requirements, or the worker trusts keys
local trusting = raw and string.find(raw, '"trusts"', 1, true) ~= nil
-- The worker's resources, decoded, or nil when they are not a JSON object. A trusting worker whose
-- resources do not decode trusts no key (it runs nothing rather than unsigned work).
local function decode_resources()
  local ok, res = pcall(cjson.decode, raw)
  if ok and type(res) == 'table' then
    return res
  end
  if trusting then
    return {trusts = ','}
  end
  return {}
end
-- A lender's limits (--max-task-hours, --accept-from): each candidate job is checked against them.
local limited = raw and (string.find(raw, '"max_task_hours"', 1, true) or string.find(raw, '"accept_from"', 1, true))
if trusting or limited then
  resources = decode_resources()
end
local KEY_ID = 4 + 6  -- where the job's key_id sits in JOB_FIELDS (CHOOSE_BY fields, then TAKE_JOB's)
-- what we choose by (the first CHOOSE_BY fields), then what take() needs, in one read per candidate job
local JOB_FIELDS = {'classes', 'running', 'created_at', 'pending_cost', unpack(TAKE_JOB)}
local CHOOSE_BY = 4
JOB_FIELDS[#JOB_FIELDS + 1] = 'submitter'  -- the credential that submitted it (lender_accepts)
local SUBMITTER = #JOB_FIELDS
local NO_REQUIREMENTS = '[[]]'
-- Job fields the lease carries as numbers (their position in JOB_FIELDS), as the worker reads them.
local NUMERIC = {{'timeout', CHOOSE_BY + 5, 'number'}, {'expires_at', CHOOSE_BY + 7, 'number'},
  {'max_attempts', CHOOSE_BY + 8, 'integer'}}
-- The job fields a lease carries as text: a missing one would cut the reply short.
local REQUIRED = {{'id', CHOOSE_BY + 2}, {'script_sha', CHOOSE_BY + 3}, {'script_name', CHOOSE_BY + 4}}

-- Text that Python's int() (kind 'integer') or float() ('number') reads as Lua does, or nil.
local function numeric(text, kind)
  if type(text) ~= 'string' then
    return nil
  end
  if kind == 'integer' then
    if string.find(text, '^%s*[-+]?%d+%s*$') and #text <= 15 then
      return tonumber(text)
    end
    return nil
  end
  return decimal(text)
end

-- Why a queued task (and its job) cannot be leased to a worker, or nil: the fields the lease carries.
local function malformed(task, job, index)
  for _, f in ipairs(REQUIRED) do
    if type(job[f[2]]) ~= 'string' then
      return "its job's field '" .. f[1] .. "' is missing"
    end
  end
  for _, f in ipairs(NUMERIC) do
    local v = job[f[2]]
    if v ~= false and v ~= nil and numeric(v, f[3]) == nil then  -- expires_at may be absent
      return "its job's field '" .. f[1] .. "' is not a number"
    end
  end
  if type(job[CHOOSE_BY + 5]) ~= 'string' then
    return "its job's field 'timeout' is missing"
  end
  if type(job[CHOOSE_BY + 8]) ~= 'string' then
    return "its job's field 'max_attempts' is missing"
  end
  if numeric(task[3], 'integer') ~= index then
    return "its field 'index' is not its index"
  end
  if task[2] and numeric(task[2], 'integer') == nil then
    return "its field 'attempts' is not a number"
  end
  if type(task[4]) ~= 'string' then
    return "its field 'payload' is missing"
  end
  return nil
end

-- queued -> failed without running: a task that cannot be leased (see malformed). Each write may meet
-- a key of the wrong type (an attacker's): none of them may raise.
local function refuse(t, why)
  local ms = now_ms()
  redis.pcall('HSET', t.task_key, 'status', 'failed', 'lease', '', 'error', 'malformed task: ' .. why,
    'error_kind', 'refused', 'finished_at', secs(ms))
  pcall(move, t.job_key, 'queued', 'failed')
  pcall(incr, t.job_key, 'failed:refused', 1)
  pcall(incr, PREFIX .. 'stats', 'attempts_failed:refused', 1)
  pcall(emit, events_key, 'task', t.task_id, 'failed')
  pcall(ended, t.job_key, t.task_id, 'failed')
  if redis.pcall('RPUSH', t.job_key .. ':failed', t.task_id) == 101 then
    redis.pcall('LTRIM', t.job_key .. ':failed', 0, 99)
  end
  pcall(maybe_finish, t.job_key, events_key, t.job_id, ms)
end

-- The requirement classes (JSON) say this worker may run class klass; nil when they do not decode.
local function meets_class(classes, klass)
  local ok, all = pcall(cjson.decode, classes)
  if not ok or type(all) ~= 'table' then
    return nil
  end
  local reqs = all[tonumber(klass) + 1] or {}
  if type(reqs) ~= 'table' then
    return nil
  end
  if #reqs == 0 then
    return true
  end
  resources = resources or (raw and decode_resources()) or {}
  local fine, meets = pcall(meets_all, reqs, resources)
  if not fine then
    return nil
  end
  return meets
end

-- Whether the task at pending member ``member`` of job ``job_id`` waits for another worker than this one:
-- its last attempt failed here (fail.lua's 'avoid'), or it ran out of memory and waits for a worker with
-- more of it ('bigger' above 'bigger_than') while the one fail.lua found ('bigger_on') is live; either
-- until 'avoid_until'.
-- avoided_by decides from those fields already read (AVOID's, at f[at + 1] ... f[at + 5]; f may be a
-- pcall's error or false).
local AVOID = {'avoid', 'avoid_until', 'bigger', 'bigger_than', 'bigger_on'}
local function avoided_by(f, at)
  local until_ms = type(f) == 'table' and not f.err and tonumber(f[at + 2])
  if not until_ms or until_ms <= now_ms() then  -- the clock is read only for a task with an avoid_until
    return false
  end
  local key, above, on = f[at + 3], tonumber(f[at + 4]), f[at + 5]
  if type(key) == 'string' and key ~= '' and type(on) == 'string' then
    resources = resources or (raw and decode_resources()) or {}
    local have = decimal(tostring(resources[key]))
    if have and above and have >= above * 1.2 then  -- fail.lua's MORE: this worker has more
      return false
    end
    if redis.call('EXISTS', PREFIX .. 'worker:' .. on) == 1 then
      return true  -- the worker with more is live: it is that one's
    end
  end
  return f[at + 1] == worker_id
end
local function avoided(job_id, member)
  local index = numeric(member, 'integer')
  if not index then
    return false
  end
  return avoided_by(redis.pcall('HMGET', PREFIX .. 'task:' .. job_id .. '-' .. index, unpack(AVOID)), 0)
end
-- The lightest of the first few pending tasks this worker need not leave to others, or nil (none: this
-- job is not for this worker now).
local function unavoided(job_id, pk)
  local some = redis.call('ZRANGE', pk, 0, 7, 'WITHSCORES')
  for i = 1, #some, 2 do
    if not avoided(job_id, some[i]) then
      return {some[i], some[i + 1]}
    end
  end
  return nil
end

local skip = {}  -- ready members left to other workers in this dispatch (see avoided)
for _ = 1, 8 do  -- more than once only when a pending entry turns out stale, or a task is left to others
  local entries = redis.call('ZREVRANGE', ready_key, 0, -1, 'WITHSCORES')
  local best, best_prio, best_running, best_left, best_created, best_job, best_class, best_fields
  for i = 1, #entries, 2 do
    local member, prio = entries[i], tonumber(entries[i + 1])
    if best and prio < best_prio then
      break
    end
    if not skip[member] then  -- left to other workers in this dispatch (see avoided)
      local job_id, klass = string.match(member, '^(.*)/(%d+)$')
      if klass and #klass > 6 then
        job_id = nil  -- no job has a million requirement classes
      end
      local job = job_id and redis.pcall('HMGET', PREFIX .. 'job:' .. job_id, unpack(JOB_FIELDS))
      local classes = type(job) == 'table' and not job.err and job[1]  -- JSON: per requirement class, its requirements
      local ok = true
      if type(classes) == 'string' and classes ~= NO_REQUIREMENTS then
        ok = meets_class(classes, klass)
      end
      if type(classes) ~= 'string' or ok == nil or redis.call('TYPE', pending_key(job_id, klass)).ok ~= 'zset' then
        redis.call('ZREM', ready_key, member)  -- drained, cancelled or deleted (or not a job at all)
      else
        if ok and trusting then
          ok = accepts_signer(resources, job[KEY_ID])  -- an unsigned or foreign-signed job is for other workers
        end
        if ok and limited then  -- a task longer than the lender allows, or a submitter it does not accept
          ok = lender_accepts(resources, job[CHOOSE_BY + 5], job[SUBMITTER])
        end
        if ok then
          local running, left, created = tonumber(job[2]) or 0, tonumber(job[4]) or 0, tonumber(job[3]) or 0
          if not best or running < best_running or (running == best_running and (left < best_left or
              (left == best_left and created < best_created))) then
            best, best_prio, best_running, best_left, best_created = member, prio, running, left, created
            best_job, best_class, best_fields = job_id, klass, job
          end
        end
      end
    end
  end
  if not best then
    return go_idle()
  end

  local job_key = PREFIX .. 'job:' .. best_job
  local pk = pending_key(best_job, best_class)
  local pick, heaviest
  if n > 1 then
    heaviest = redis.call('ZREVRANGE', pk, 0, 0, 'WITHSCORES')
    local queued_cost = tonumber(best_fields[4] or 0) or 0  -- pending_cost
    local horizon = math.max(queued_cost / math.max(sum, 1e-9), tonumber(heaviest[2]) / math.max(max, 1e-9))
    local limit = score * horizon * (1 + 1e-9)
    pick = redis.call('ZREVRANGEBYSCORE', pk, limit, '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if pick[1] and score < max and tonumber(pick[2]) >= tonumber(heaviest[2]) then
      -- the heaviest cost is the strongest worker's, while a lighter task is there for this one
      local lighter = redis.call('ZREVRANGEBYSCORE', pk, '(' .. heaviest[2], '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
      if lighter[1] then
        pick = lighter
      end
    end
  end
  if not pick or not pick[1] then
    pick = redis.call('ZRANGE', pk, 0, 0, 'WITHSCORES')
  end
  local task  -- the pick's TAKE_TASK fields, read with its AVOID fields (only a fleet of more than one avoids)
  if pick[1] and n > 1 then
    local index = numeric(pick[1], 'integer')
    local fields = {unpack(TAKE_TASK)}
    for _, name in ipairs(AVOID) do
      fields[#fields + 1] = name
    end
    local f = index and index >= 0 and redis.pcall('HMGET', PREFIX .. 'task:' .. best_job .. '-' .. index,
      unpack(fields))
    if avoided_by(f, #TAKE_TASK) then
      pick = unavoided(best_job, pk)  -- it waits for another worker: the next few it need not leave
    else
      task = f or nil
    end
  end
  if not pick then
    skip[best] = true  -- its tasks wait for another worker: look at the other jobs
  else
    local index, cost = numeric(pick[1], 'integer'), tonumber(pick[2])
    if not index or index < 0 then  -- not a task's index: out of the pending set, and look again
      redis.call('ZREM', pk, pick[1])
      index = -1
    end
    local task_id = best_job .. '-' .. index
    local task_key = PREFIX .. 'task:' .. task_id
    if index < 0 then
      task = {}
    elseif not task then
      task = redis.pcall('HMGET', task_key, unpack(TAKE_TASK))
    end
    if task.err then
      task = {}  -- not a hash: not a task
    end
    -- two members seen (the heaviest and another, which unpend removes as pad(index)): the pending set
    -- stays after this one leaves it
    local remains = heaviest ~= nil and heaviest[1] ~= nil and heaviest[1] ~= pick[1] and index >= 0 and
      heaviest[1] ~= pad(index)
    local taken = {task_key = task_key, job_key = job_key, ready_key = ready_key, job_id = best_job, index = index,
      cost = cost, klass = best_class, remains = remains}
    local why = task[1] == 'queued' and malformed(task, best_fields, index)
    if why then
      unpend(taken)
      redis.call('ZREM', pk, pick[1])
      refuse({task_key = task_key, job_key = job_key, task_id = task_id, job_id = best_job}, why)
    elseif task[1] == 'queued' then  -- its status
      unpend(taken)
      redis.call('SREM', idle_key, worker_id)
      return take({
        task_key = task_key, lease_key = PREFIX .. 'lease:' .. task_id, leases_key = leases_key, job_key = job_key,
        events_key = events_key, worker_key = worker_key, task_id = task_id, worker_id = worker_id, ttl_ms = ttl_ms,
        ms = now_ms(), task = task, job = best_fields, job_from = CHOOSE_BY, worker_known = raw ~= nil,
        fleet_version = version, token = token,
      })
    end
    if not why then
      -- not queued any more: a stale entry, drop it (and its cost from the horizon) and look again
      if index >= 0 then
        unpend(taken)
      end
      redis.call('ZREM', pk, pick[1])  -- the member as it is (unpend removes it padded)
    end
  end
end
return go_idle()

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_acquire', callback=function(KEYS, ARGV)
-- acquire: queued -> running for one named task (operators and tests; workers take work by dispatch.lua).
-- Only a queued task can be leased; anything else answers why not.
--
-- acquire(
--   keys = {task hash, lease key, leases zset, job hash, events stream, worker hash, ready zset},
--   args = {task id, worker id, lease TTL (ms), lease token (made by the worker; only its digest is stored)}
-- )
-- Reply (see _lib.lua): the lease (lease_reply), or {0, why}: why = 'missing' or the task's status.

local task_key = KEYS[1]
local lease_key = KEYS[2]
local leases_key = KEYS[3]
local job_key = KEYS[4]
local events_key = KEYS[5]
local worker_key = KEYS[6]
local ready_key = KEYS[7]

local task_id = ARGV[1]
local worker_id = ARGV[2]
local ttl_ms = tonumber(ARGV[3])
local token = ARGV[4]

local task = redis.call('HMGET', task_key, unpack(TAKE_TASK))
local status = task[1]
if not status then
  return {0, 'missing'}
end
if status ~= 'queued' then
  return {0, status}
end
unpend({task_key = task_key, job_key = job_key, ready_key = ready_key, job_id = job_of(task_id)})
return take({
  task_key = task_key, lease_key = lease_key, leases_key = leases_key, job_key = job_key, events_key = events_key,
  worker_key = worker_key, task_id = task_id, worker_id = worker_id, ttl_ms = ttl_ms, ms = now_ms(), task = task,
  token = token,
})

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_complete', callback=function(KEYS, ARGV)
-- complete: running -> done, fenced by the lease token: a stale holder changes nothing. The token may
-- be the primary's or a backup copy's (speculation): the first fenced completion wins.
--
-- complete(
--   keys = {task hash, lease key, leases zset, job hash, events stream, worker hash, stats hash,
--           duration histogram hash, staged files hash, task files hash, the job's spent set},
--   args = {task id, lease token (the plain token: its digest is what the task holds), result (JSON), duration (s),
--           the completing worker's score (0: unknown), for the job's seconds-per-unit estimate,
--           artifact index (JSON, '' for none), its bytes, its object store URL ('' = the broker),
--           1 when the staged files hash is to become the task's files (broker-stored artifacts),
--           this task's member in the spent set ('' = none: not a signed task), then field/value pairs
--           stored with the result (the worker's result proof, signing.py)}
-- )
-- The winner's output files are kept in the same step as its result: a losing copy's stay staged and
-- expire (store/artifacts.py).
-- Reply (see _lib.lua): {1, 'done'} (also for a repeat of the winning call), or {0, why}: why = the task's status, 'missing' or 'stale'
-- (another lease holds it).

local task_key = KEYS[1]
local lease_key = KEYS[2]
local leases_key = KEYS[3]
local job_key = KEYS[4]
local events_key = KEYS[5]
local worker_key = KEYS[6]
local stats_key = KEYS[7]
local histogram_key = KEYS[8]
local staged_key = KEYS[9]
local files_key = KEYS[10]

local task_id = ARGV[1]
local token = ARGV[2]
local result = ARGV[3]
local duration = ARGV[4]  -- kept as sent ('%.3f'), stored as is
local score = tonumber(ARGV[5] or 0) or 0
local artifacts = ARGV[6] or ''
local artifact_bytes = tonumber(ARGV[7] or 0) or 0
local artifact_store = ARGV[8] or ''
local promote = ARGV[9] == '1'
local spent_key, spent = KEYS[11], ARGV[10] or ''

-- In one read: the fence's fields (t[1..3]), the primary's attempt record (t[4..8]) and the cost (t[9]).
local read = {unpack(ATTEMPT_FIELDS.primary)}
read[6] = 'cost'
local copy, refused, has_backup, t = holder(task_key, token, read)
if not copy then
  -- The same completion again (its first reply was lost and the call retried): it did win.
  if refused[2] == 'done' and token ~= '' and redis.call('HGET', task_key, 'done_token') == done_token(token) then
    return {1, 'done'}
  end
  return refused
end
local ms = now_ms()
if copy == 'backup' then
  incr(stats_key, 'speculative_wins', 1)
end
local primary = attempt_rec('primary', t, 3)
local won  -- the backup copy's record when it won (read before clear_backup empties its fields)
if copy == 'backup' then
  won = attempt_of(task_key, 'backup')
  attempt_log(job_key, won, 'done', nil, ms)
  attempt_log(job_key, primary, 'superseded', nil, ms)
else
  attempt_log(job_key, primary, 'done', nil, ms)
  if has_backup then
    attempt_log(job_key, attempt_of(task_key, 'backup'), 'superseded', nil, ms)
  end
end
if has_backup then
  clear_backup(task_key)
end
local cost = tonumber(t[9] or 1) or 1  -- read before the result's fields are written
redis.call('HSET', task_key, 'status', 'done', 'result', result, 'finished_at', secs(ms), 'duration', duration,
  'done_token', done_token(token))
-- A finished task keeps only what its readers show: the fields every running task had go (an absent field reads
-- as empty), so that a million done tasks stay small (docs/finished-work.md). A task that had a backup copy
-- keeps clear_backup's empty fields: few do.
redis.call('HDEL', task_key, 'lease', 'error', 'promoted')
if won then  -- the result is the backup's: `results`, `status` and the dashboard name the worker that made it
  redis.call('HSET', task_key, 'worker', won.worker)
  if won.started ~= '' then
    redis.call('HSET', task_key, 'started_at', won.started)
  end
end
for i = 11, #ARGV - 1, 2 do
  redis.call('HSET', task_key, ARGV[i], ARGV[i + 1])
end
if spent ~= '' and spent_key and redis.call('SISMEMBER', spent_key, '*') == 1 then
  redis.call('SADD', spent_key, spent)  -- a trusting worker never runs this task again (signing.py)
end
redis.call('DEL', lease_key)
redis.call('ZREM', leases_key, task_id)
local still_running = move(job_key, 'running', 'done')
if score > 0 then  -- seconds per (cost / score): how the dispatcher's callers estimate a straggler's end
  incr(job_key, 'unit_sum', tonumber(duration) * score / cost, true)
  incr(job_key, 'unit_n', 1)
end
incr(stats_key, 'done', 1)
observe_duration(histogram_key, tonumber(duration))
clear_current(worker_key, task_id)
if promote and redis.call('EXISTS', staged_key) == 0 then
  artifacts = ''  -- its staging expired before it completed: no index that names missing chunks
  incr(stats_key, 'artifacts_lost', 1)
  redis.call('HSET', task_key, 'artifacts_lost', '1')  -- its result proof names an index it lacks (signing.py)
end
if artifacts ~= '' then
  redis.call('HSET', task_key, 'artifacts', artifacts)
  incr(job_key, 'artifact_bytes', artifact_bytes)
  if artifact_store ~= '' then
    redis.call('HSET', job_key, 'artifact_store', artifact_store)
  end
  if promote then
    redis.call('RENAME', staged_key, files_key)
    redis.call('PERSIST', files_key)
  end
end
emit(events_key, 'task', task_id, 'done')
ended(job_key, task_id, 'done')
if not still_running or still_running <= 0 then  -- else the job has not ended: no need to read its counters
  maybe_finish(job_key, events_key, job_of(task_id), ms)
end
return {1, 'done'}

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_fail', callback=function(KEYS, ARGV)
-- fail: running -> queued (attempts left) or failed; fenced by the lease token.
--
-- fail(
--   keys = {task hash, lease key, leases zset, job hash, events stream, worker hash, ready zset, stats hash,
--           idle set, the job's spent set, scores zset (the live workers)},
--   args = {task id, lease token (the plain token), error text, duration (s), mode,
--           this task's member in the spent set ('' = none),
--           how long (ms) the failed worker leaves the requeued task to others ('' or 0: not at all),
--           the failure kind (_lib.lua: script, timeout, memory, lost, refused; '' = script),
--           for 'memory': the resource it ran out of ('task_memory_gb' or 'vram_gb', '' = unknown) and this
--           worker's value of it, and how long (ms) the task waits for a worker with more}
-- )
-- A task requeued after running out of memory waits for a live worker with more of that resource (at
-- least 1.2 times as much) that may run it: the one with most is named in 'bigger_on', and dispatch gives
-- the task only to workers with that much while that one is live, for up to the time given; with no such
-- worker live it is retried like any failure.
-- A task requeued after a failed attempt names the worker it failed on ('avoid', until 'avoid_until'):
-- dispatch gives it to another live worker meanwhile, so one sick worker does not spend every attempt.
-- mode: 'fail'; 'release' to hand the task back without spending an attempt; 'reject' to fail it for
-- good whatever attempts remain (a task that must never run, such as a bad signature).
-- A signed job's task that fails for good joins its spent set: no trusting worker runs it again unless
-- the submitter retries it (retry.lua takes it out again).
-- Reply (see _lib.lua): {1, 'queued' | 'failed', 'attempts', attempts spent}, {0, why} as complete.lua,
-- or {1, 'running', 'attempts', 0} when the task runs on: a backup copy ended (it is dropped), or the
-- primary ended while a live backup runs (the backup becomes the primary).

local task_key = KEYS[1]
local lease_key = KEYS[2]
local leases_key = KEYS[3]
local job_key = KEYS[4]
local events_key = KEYS[5]
local worker_key = KEYS[6]
local ready_key = KEYS[7]
local stats_key = KEYS[8]
local idle_key = KEYS[9]
local spent_key = KEYS[10]  -- declared; the name used is made from the task id (below)
local scores_key = KEYS[11]

local task_id = ARGV[1]
local token = ARGV[2]
local err = ARGV[3]
local duration = ARGV[4]
local mode = ARGV[5]
local spent = ARGV[6] or ''
local avoid_ms = tonumber(ARGV[7] or '') or 0
local kind = ARGV[8] or ''
local need_key = ARGV[9] or ''
local need_value = tonumber(ARGV[10] or '')
local hold_ms = tonumber(ARGV[11] or '') or 0
local KINDS = {script = true, timeout = true, memory = true, lost = true, refused = true, environment = true}
if not KINDS[kind] then
  kind = 'script'
end

-- The live worker with the most of resource ``key``, at least MORE times ``above``, that may run this task
-- (it meets the task's requirements and trusts its job's signer), and how much it has; or nil. Anything
-- a credential wrote that does not decode counts as a worker that may not run it.
local MORE = 1.2  -- "more memory" is this much more: two machines of one size differ by a few MB
local function bigger_worker(key, above)
  local job = redis.pcall('HMGET', job_key, 'classes', 'key_id', 'timeout', 'submitter')
  local klass = redis.pcall('HGET', task_key, 'class')
  if type(job) ~= 'table' or job.err or type(job[1]) ~= 'string' then
    return nil
  end
  local ok, classes = pcall(cjson.decode, job[1])
  local reqs = ok and type(classes) == 'table' and classes[(tonumber(klass) or 0) + 1] or {}
  if type(reqs) ~= 'table' then
    return nil
  end
  local best, most = nil, above * MORE
  for _, id in ipairs(redis.call('ZRANGE', scores_key, 0, 1999)) do
    local raw = redis.pcall('HGET', PREFIX .. 'worker:' .. id, 'resources')
    if type(raw) == 'string' and #raw <= 65536 then
      local fine, res = pcall(cjson.decode, raw)
      local have = fine and type(res) == 'table' and decimal(tostring(res[key]))
      if have and have >= most and accepts_signer(res, job[2]) and lender_accepts(res, job[3], job[4]) then
        local meets_ok, meets = pcall(meets_all, reqs, res)
        if meets_ok and meets then
          best, most = id, have
        end
      end
    end
  end
  return best, most
end

local copy, refused = holder(task_key, token)
if not copy then
  return refused
end
local ms = now_ms()
clear_current(worker_key, task_id)
local ended_as = mode == 'release' and 'handed back' or 'failed'
local ended_kind = mode ~= 'release' and kind or nil  -- handed back: not a failure
local rec = attempt_of(task_key, copy)
if copy == 'backup' then
  attempt_log(job_key, rec, ended_as, ended_kind, ms)
  clear_backup(task_key)
  return {1, 'running', 'attempts', 0}
end
if mode ~= 'reject' and promote_backup({task_key = task_key, lease_key = lease_key, leases_key = leases_key,
    task_id = task_id, ms = ms}) then
  if err ~= '' then
    redis.call('HSET', task_key, 'error', err, 'error_kind', kind)
  end
  if mode == 'fail' then
    incr(stats_key, 'attempts_failed:' .. kind, 1)  -- the primary's attempt failed; its backup runs on
  end
  attempt_log(job_key, rec, ended_as, ended_kind, ms)
  return {1, 'running', 'attempts', 0}
end
local failed_on = redis.call('HGET', task_key, 'worker')
redis.call('DEL', lease_key)
redis.call('ZREM', leases_key, task_id)
-- a backup not promoted (refused task, or its lease lapsed: attempt_log records that as lost) is stopped
attempt_log(job_key, attempt_of(task_key, 'backup'), 'cancelled', nil, ms)
clear_backup(task_key)
local r = end_attempt({
  task_key = task_key, job_key = job_key, events_key = events_key, ready_key = ready_key, idle_key = idle_key,
  stats_key = stats_key, task_id = task_id, error = err, duration = duration, ms = ms,
  refund = mode == 'release', final = mode == 'reject', kind = kind,
})
attempt_log(job_key, rec, (mode == 'fail' and r[2] == 'queued') and 'retried' or ended_as, ended_kind, ms)
redis.call('HDEL', task_key, 'bigger', 'bigger_than', 'bigger_on')
if r[2] == 'queued' and mode == 'fail' and kind == 'memory' and need_key ~= '' and need_value then
  local bigger, most = bigger_worker(need_key, need_value)
  if bigger then
    redis.call('HSET', task_key, 'avoid', failed_on or '', 'avoid_until', ms + math.max(hold_ms, avoid_ms),
      'bigger', need_key, 'bigger_than', need_value, 'bigger_on', bigger)
    table.insert(r, 'bigger_on')
    table.insert(r, bigger)
    table.insert(r, 'bigger_has')
    table.insert(r, tostring(most))
    return r
  end
end
if r[2] == 'queued' and mode == 'fail' and avoid_ms > 0 and type(failed_on) == 'string' then
  redis.call('HSET', task_key, 'avoid', failed_on, 'avoid_until', ms + avoid_ms)
end
if r[2] == 'failed' and spent ~= '' and redis.call('SISMEMBER', PREFIX .. 'spent:' .. (job_of(task_id) or ''), '*') == 1 then
  redis.call('SADD', PREFIX .. 'spent:' .. job_of(task_id), spent)  -- ended for good (only a signed job has the set)
end
return r

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_heartbeat', callback=function(KEYS, ARGV)
-- heartbeat: renew the worker's registration and, if it holds one, its lease; report cancellation.
-- A different or missing epoch means the broker lost its data: nothing else is touched.
--
-- heartbeat(
--   keys = {worker hash, workers zset, lease key, leases zset, task hash (unused when idle), epoch string},
--   args = {worker id, worker TTL (ms), lease token (the plain token) or '', lease TTL (ms), task id or '',
--           the epoch the worker joined}
-- )
-- Reply (see _lib.lua): {1, lease state, 'registered', 0|1, 'server_ms', server time (ms)}, the lease
-- state 'none' | 'ok' | 'lost' | 'cancelled'; or {0, 'epoch changed', 'server_ms', server time (ms)}.

local worker_key = KEYS[1]
local workers_key = KEYS[2]
local lease_key = KEYS[3]
local leases_key = KEYS[4]
local task_key = KEYS[5]
local epoch_key = KEYS[6]

local worker_id = ARGV[1]
local worker_ttl_ms = ARGV[2]
local token = ARGV[3]
local ttl_ms = tonumber(ARGV[4])
local task_id = ARGV[5]
local epoch = ARGV[6]

local ms = now_ms()
if redis.call('GET', epoch_key) ~= epoch then
  return {0, 'epoch changed', 'server_ms', ms}
end
local registered = redis.call('EXISTS', worker_key)
if registered == 1 then
  redis.call('HSET', worker_key, 'last_heartbeat', secs(ms))
  redis.call('PEXPIRE', worker_key, worker_ttl_ms)
  redis.call('ZADD', workers_key, ms, worker_id)
end
local lease = 'none'
if token ~= '' then
  local t = redis.call('HMGET', task_key, 'status', 'lease', 'backup')
  local status, primary, backup = t[1], t[2], t[3]
  token = digest(token)
  if status == 'cancelled' then
    lease = 'cancelled'
  elseif status == 'running' and primary == token then
    redis.call('SET', lease_key, token, 'PX', ttl_ms)
    redis.call('ZADD', leases_key, ms + ttl_ms, task_id)
    lease = 'ok'
  elseif status == 'running' and backup == token then
    redis.call('HSET', task_key, 'backup_until', ms + ttl_ms)  -- a backup copy's lease
    lease = 'ok'
  else
    lease = 'lost'
  end
end
return {1, lease, 'registered', registered, 'server_ms', ms}

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_reap', callback=function(KEYS, ARGV)
-- reap: a running task whose lease key has lapsed goes back to queued (or failed at max_attempts),
-- unless a live backup copy runs it: that copy becomes the primary.
--
-- reap(
--   keys = {task hash, lease key, leases zset, job hash, events stream, ready zset, stats hash, idle set,
--           the job's spent set},
--   args = {task id, this task's member in the spent set ('' = none)}
-- )
-- A signed job's task failed for good here joins its spent set, as in fail.lua.
-- A lapsed lease is a 'lost' attempt: retried without spending an attempt up to a bound (end_attempt).
-- Reply (see _lib.lua): end_attempt's {1, 'queued' | 'failed', 'attempts', attempts spent, ...}; or
-- {0, 'renewed'} (the lease is still alive, or a live backup took over) or {0, 'gone'} (not running).

local task_key = KEYS[1]
local lease_key = KEYS[2]
local leases_key = KEYS[3]
local job_key = KEYS[4]
local events_key = KEYS[5]
local ready_key = KEYS[6]
local stats_key = KEYS[7]
local idle_key = KEYS[8]
local spent_key = KEYS[9]  -- declared; the name used is made from the task id (below)

local task_id = ARGV[1]
local spent = ARGV[2] or ''

local t = redis.call('HMGET', task_key, 'status', 'worker')
local status, worker = t[1], t[2]
local ms = now_ms()
if status ~= 'running' then
  redis.call('ZREM', leases_key, task_id)
  return {0, 'gone'}
end
local pttl = redis.call('PTTL', lease_key)
if pttl > 0 then
  redis.call('ZADD', leases_key, ms + pttl, task_id)
  return {0, 'renewed'}
end
local rec = attempt_of(task_key, 'primary')
if promote_backup({task_key = task_key, lease_key = lease_key, leases_key = leases_key, task_id = task_id,
    ms = ms}) then
  attempt_log(job_key, rec, 'lost', 'lost', ms)
  return {0, 'renewed'}  -- the primary is gone, its live backup carries on as the primary
end
redis.call('DEL', lease_key)
redis.call('ZREM', leases_key, task_id)
attempt_log(job_key, rec, 'lost', 'lost', ms)
attempt_log(job_key, attempt_of(task_key, 'backup'), 'lost', 'lost', ms)  -- lapsed too (else promoted above)
clear_backup(task_key)
local err = 'lease expired: worker ' .. (worker or '?') .. ' stopped heartbeating'
incr(stats_key, 'lease_expired', 1)
local r = end_attempt({
  task_key = task_key, job_key = job_key, events_key = events_key, ready_key = ready_key, idle_key = idle_key,
  stats_key = stats_key, task_id = task_id, error = err, duration = '', ms = ms, kind = 'lost', free = true,
})
if r[2] == 'failed' and spent ~= '' and redis.call('SISMEMBER', PREFIX .. 'spent:' .. (job_of(task_id) or ''), '*') == 1 then
  redis.call('SADD', PREFIX .. 'spent:' .. job_of(task_id), spent)  -- ended for good (only a signed job has the set)
end
return r

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_cancel', callback=function(KEYS, ARGV)
-- cancel: queued|running -> cancelled. A running task's worker learns it at its next heartbeat.
--
-- cancel(
--   keys = {task hash, lease key, leases zset, job hash, events stream, ready zset, the job's spent set},
--   args = {task id, this task's member in the spent set ('' = none)}
-- )
-- A signed job's cancelled task joins its spent set: it has ended for good, and no trusting worker runs it
-- again unless the submitter retries it (retry.lua takes it out again).
-- Reply (see _lib.lua): {1, 'cancelled', 'previous', the status it had}, or {0, status or 'missing'}
-- when it had already ended.

local task_key = KEYS[1]
local lease_key = KEYS[2]
local leases_key = KEYS[3]
local job_key = KEYS[4]
local events_key = KEYS[5]
local ready_key = KEYS[6]
local spent_key = KEYS[7]  -- declared; the name used is made from the task id (below)

local task_id = ARGV[1]
local spent = ARGV[2] or ''

local status = redis.call('HGET', task_key, 'status')
if status ~= 'queued' and status ~= 'running' then
  return {0, status or 'missing'}
end
local ms = now_ms()
local job_id = job_of(task_id)
if status == 'queued' then
  unpend({task_key = task_key, job_key = job_key, ready_key = ready_key, job_id = job_id})
end
if status == 'running' then
  attempt_log(job_key, attempt_of(task_key, 'primary'), 'cancelled', nil, ms)
  attempt_log(job_key, attempt_of(task_key, 'backup'), 'cancelled', nil, ms)
end
redis.call('HSET', task_key, 'status', 'cancelled', 'lease', '', 'finished_at', secs(ms))
clear_backup(task_key)
redis.call('DEL', lease_key)
redis.call('ZREM', leases_key, task_id)
move(job_key, status, 'cancelled')
if spent ~= '' and redis.call('SISMEMBER', PREFIX .. 'spent:' .. (job_of(task_id) or ''), '*') == 1 then
  redis.call('SADD', PREFIX .. 'spent:' .. job_of(task_id), spent)  -- only a signed job has one (made at submit, with its TTL)
end
emit(events_key, 'task', task_id, 'cancelled')
ended(job_key, task_id, 'cancelled')
maybe_finish(job_key, events_key, job_id, ms)
return {1, 'cancelled', 'previous', status}

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_retry', callback=function(KEYS, ARGV)
-- retry: failed (or, when asked, cancelled) -> queued with a fresh set of attempts; the job opens again.
--
-- retry(
--   keys = {task hash, job hash, events stream, ready zset, idle set, the job's spent set},
--   args = {task id, '1' to re-queue a cancelled task too, this task's member in the spent set}
-- )
-- A signed task that ended (failed for good, cancelled) is in its job's spent set, and trusting workers
-- refuse it; retry takes it out. That SREM is the first write, before anything changes: a worker
-- credential may not SREM a spent set, so its call of this function fails there and changes nothing
-- (a function is not a transaction: the writes before an error would stay).
-- Reply (see _lib.lua): {1, 'queued'}, or {0, status or 'missing'} for a task it may not re-queue.

local task_key = KEYS[1]
local job_key = KEYS[2]
local events_key = KEYS[3]
local ready_key = KEYS[4]
local idle_key = KEYS[5]
local spent_key = KEYS[6]  -- declared; the script uses the name it makes itself (below)

local task_id = ARGV[1]
local cancelled_too = ARGV[2] == '1'
local spent = ARGV[3] or ''

local status = redis.call('HGET', task_key, 'status')
if status ~= 'failed' and not (cancelled_too and status == 'cancelled') then
  return {0, status or 'missing'}
end
-- First: see above (a no-op for an unsigned job). The set's name is made here from the task id, not taken
-- from KEYS, so a caller cannot skip this step by naming another key.
redis.call('SREM', PREFIX .. 'spent:' .. (job_of(task_id) or ''), spent)
local job_id = job_of(task_id)
local kind = status == 'failed' and redis.call('HGET', task_key, 'error_kind')
if type(kind) == 'string' and (tonumber(redis.pcall('HGET', job_key, 'failed:' .. kind)) or 0) > 0 then
  incr(job_key, 'failed:' .. kind, -1)  -- a task failed before kinds were recorded has none to take back
end
redis.call('HSET', task_key, 'status', 'queued', 'attempts', 0, 'lease', '')
redis.call('HDEL', task_key, 'finished_at', 'duration', 'lost', 'avoid', 'avoid_until', 'bigger', 'bigger_than',
  'bigger_on')
move(job_key, status, 'queued')
make_pending({task_key = task_key, job_key = job_key, ready_key = ready_key, idle_key = idle_key, job_id = job_id})
local job = redis.call('HMGET', job_key, 'status', 'id')
local job_status, job_hash_id = job[1], job[2]
if job_status == 'done' or job_status == 'failed' or job_status == 'cancelled' then
  redis.call('HSET', job_key, 'status', 'running')
  redis.call('HDEL', job_key, 'finished_at')
  emit(events_key, 'job', job_hash_id, 'running')
end
emit(events_key, 'task', task_id, 'queued')
return {1, 'queued'}

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_speculate', callback=function(KEYS, ARGV)
-- speculate: start a backup copy of a running task on a stronger worker (a straggler's twin).
-- Allowed when the task's job allows it (the default; submit --no-speculate turns it off), the task has
-- no live backup, this worker is at least `speedup` times as strong as the primary's, and either
--   mode 'idle': the job has nothing left queued (the end of a job, this worker found nothing else), or
--   mode 'straggler': the caller found the primary would end long after the rest of the work (a much
--   stronger worker joined after a weak one took a heavy task); the job may still have queued tasks.
-- The first fenced completion of either copy wins (complete.lua); the other learns 'lost' at its
-- next heartbeat and is killed. A backup does not spend an attempt.
--
-- speculate(
--   keys = {task hash, job hash, worker hash, scores zset, stats hash},
--   args = {task id, worker id, lease TTL (ms), this worker's score,
--           minimum speed-up over the primary's worker, mode 'idle' or 'straggler',
--           the backup's lease token (made by the worker; only its digest is stored)}
-- )
-- Reply (see _lib.lua): the backup's lease (lease_reply) with 'backup', 1 and 'backup_mode', mode
-- appended; or {0, why}.

local task_key = KEYS[1]
local job_key = KEYS[2]
local worker_key = KEYS[3]
local scores_key = KEYS[4]
local stats_key = KEYS[5]

local task_id = ARGV[1]
local worker_id = ARGV[2]
local ttl_ms = tonumber(ARGV[3])
local score = tonumber(ARGV[4])
local speedup = tonumber(ARGV[5])
local mode = ARGV[6]
local token = ARGV[7]

local t = redis.call('HMGET', task_key, 'status', 'worker', 'backup', 'backup_until', 'attempts', 'index',
  'payload', 'sig', 'class', 'backup_worker', 'lease', 'promoted')
local status, primary_worker, backup, backup_until, attempts = t[1], t[2], t[3], t[4], t[5]
local index, payload, signature, klass, backup_worker = t[6], t[7], t[8], t[9], t[10]
if status ~= 'running' then
  return {0, status or 'missing'}
end
-- The same call again (redis-py sends a command again when the link failed before its reply came, though
-- this script may have run): the backup this very call started (its token, this worker) is the answer again,
-- not 'has a backup' while a copy that never runs holds the task's backup for a lease; nor 'own task' when
-- the primary failed or lapsed in between and the backup was promoted (its token is the task's lease now).
local mine = digest(token)
local resent = (backup_worker == worker_id and backup == mine) or
  (primary_worker == worker_id and t[11] == mine and t[12] == '1')
if primary_worker == worker_id and not resent then
  return {0, 'own task'}
end
local ms = now_ms()
if not resent and backup and backup ~= '' and tonumber(backup_until or 0) > ms then
  return {0, 'has a backup'}
end
local job = redis.call('HMGET', job_key, 'speculate', 'queued', 'id', 'script_sha', 'script_name', 'timeout',
  'key_id', 'expires_at', 'max_attempts', 'classes')
local speculative, queued, job_id, script_sha, script_name = job[1], job[2], job[3], job[4], job[5]
local timeout, key_id, expires_at, max_attempts, classes = job[6], job[7], job[8], job[9], job[10]
local function reply()
  return lease_reply({
    task_id = task_id, attempt = tonumber(attempts), job_id = job_id, index = index,
    payload = payload, script_sha = script_sha, script_name = script_name, timeout = timeout,
    max_attempts = max_attempts, signature = signature, key_id = key_id, expires_at = expires_at,
    server_ms = ms, backup = true, backup_mode = mode,
  })
end
if resent and job_id then
  return reply()  -- started already, by this call: nothing is written twice
end
if speculative ~= '1' then
  return {0, 'not speculative'}
end
local raw = redis.call('HGET', worker_key, 'resources')
local res = raw and cjson.decode(raw) or {}
local reqs = cjson.decode(classes or '[[]]')[tonumber(klass or 0) + 1] or {}
if not meets_all(reqs, res) then
  return {0, 'requirements not met'}
end
if not accepts_signer(res, key_id) then
  return {0, 'not signed by a key it trusts'}
end
if not lender_accepts(res, timeout, redis.call('HGET', job_key, 'submitter')) then
  return {0, 'not a job its lender accepts'}
end
if mode ~= 'straggler' and tonumber(queued) > 0 then
  return {0, 'job has queued tasks'}
end
local primary = tonumber(redis.call('ZSCORE', scores_key, primary_worker) or 0)
if primary > 0 and score < primary * speedup then
  return {0, 'not faster'}
end
attempt_log(job_key, attempt_of(task_key, 'backup'), 'lost', 'lost', ms)  -- a lapsed backup, replaced here
redis.call('HSET', task_key, 'backup', digest(token), 'backup_worker', worker_id, 'backup_until', ms + ttl_ms,
  'backup_mode', mode, 'backup_started_at', secs(ms))
incr(stats_key, 'speculated', 1)
if redis.call('EXISTS', worker_key) == 1 then
  redis.call('HSET', worker_key, 'current_task', task_id)
end
return reply()

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_wake', callback=function(KEYS, ARGV)
-- wake: new work is takeable (a submit, a retry); every idle worker gets a token on its wake list.
--
-- wake(
--   keys = {idle set},
--   args = {}
-- )
-- Reply (see _lib.lua): {1, 'woken', 'workers', the number of workers woken}.

local idle_key = KEYS[1]

local n = redis.call('SCARD', idle_key)
wake_idle(idle_key)
return {1, 'woken', 'workers', n}

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_stage', callback=function(KEYS, ARGV)
-- stage: write a chunk of a job's tasks in one call (submit): each task's hash, its place in the job's
-- task list and its member in the job's pending zset of its requirement class. Not visible to
-- dispatch until the job enters the ready index (submit's last step). One call per chunk instead of
-- one command per task keeps a 1,000,000-task submit within seconds. The chunk's tasks have consecutive
-- indexes and travel as three arguments, not five a task: packing those cost the client more than
-- Redis spent on the call. A payload is JSON text with only printable ASCII (the client escapes the
-- rest), so a newline separates two.
--
-- stage(
--   keys = {job task list},
--   args = {job id, the chunk's first index, its payloads (JSON) joined by newlines,
--           their costs joined by newlines ('' when every cost is 1),
--           their requirement classes joined by newlines ('' when every class is 0)}
-- )
-- Reply (see _lib.lua): {1, 'staged', 'tasks', the number of tasks written}.

local tasks_key = KEYS[1]

local job_id = ARGV[1]
local first = tonumber(ARGV[2])

local function lines(text)
  local out = {}
  for line in string.gmatch(text, '[^\n]+') do
    out[#out + 1] = line
  end
  return out
end
local payloads = lines(ARGV[3])
local costs = ARGV[4] ~= '' and lines(ARGV[4]) or nil
local classes = ARGV[5] ~= '' and lines(ARGV[5]) or nil
if (costs and #costs ~= #payloads) or (classes and #classes ~= #payloads) then
  return redis.error_reply('stage: ' .. #payloads .. ' payloads but ' .. (costs and #costs or #payloads) ..
    ' costs and ' .. (classes and #classes or #payloads) .. ' classes (a payload with a newline?)')
end

local task_prefix = PREFIX .. 'task:' .. job_id .. '-'
local ids = {}
local by_class = {}
for k = 1, #payloads do
  local n = first + k - 1
  local index = string.format('%d', n)
  local cost = costs and costs[k] or '1'
  local klass = classes and classes[k] or '0'
  -- one HSET a task: a default cost or class is not written (dispatch reads them as 1 and 0)
  if tonumber(cost) == 1 and klass == '0' then
    redis.call('HSET', task_prefix .. index, 'index', index, 'payload', payloads[k], 'status', 'queued')
  elseif klass == '0' then
    redis.call('HSET', task_prefix .. index, 'index', index, 'payload', payloads[k], 'status', 'queued', 'cost', cost)
  else
    local fields = {'index', index, 'payload', payloads[k], 'status', 'queued', 'class', klass}
    if tonumber(cost) ~= 1 then
      fields[#fields + 1] = 'cost'
      fields[#fields + 1] = cost
    end
    redis.call('HSET', task_prefix .. index, unpack(fields))
  end
  ids[k] = job_id .. '-' .. index
  local members = by_class[klass]
  if not members then
    members = {}
    by_class[klass] = members
  end
  members[#members + 1] = cost
  members[#members + 1] = pad(n)
end
for i = 1, #ids, 1000 do
  redis.call('RPUSH', tasks_key, unpack(ids, i, math.min(i + 999, #ids)))
end
for klass, members in pairs(by_class) do
  for i = 1, #members, 2000 do
    redis.call('ZADD', pending_key(job_id, klass), unpack(members, i, math.min(i + 1999, #members)))
  end
end
return {1, 'staged', 'tasks', #payloads}

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_project_attach', callback=function(KEYS, ARGV)
-- project_attach: a job (being submitted) refers to a project tree. The first job of a tree makes it hold each
-- of its files (a count per file in the refs hash, the stored copy's TTL dropped); a later one only joins.
-- A file the tree needs that the mesh no longer holds (a job that held it went meanwhile) is named in the
-- reply and nothing changes: the submitter sends it and calls again. Files stored in an object store (blob
-- prefix '') are present when a tree holds them or this caller just wrote them ('+' before the digest).
--
-- project_attach(
--   keys = {tree manifest, tree's jobs zset, refs hash, trees zset},
--   args = {job id, tree digest, manifest JSON, blob key prefix ('' for an object store), file digest...}
-- )
-- Reply: {1, 'attached', 'new', 0|1} or {0, 'missing', 'files', digests joined by ','}.

local tree_key = KEYS[1]
local jobs_key = KEYS[2]
local refs_key = KEYS[3]
local trees_key = KEYS[4]

local job_id = ARGV[1]
local tree = ARGV[2]
local manifest = ARGV[3]
local blob_prefix = ARGV[4]
local FIRST_FILE = 5

local ms = now_ms()
local new = redis.call('ZCARD', jobs_key) == 0 or redis.call('EXISTS', tree_key) == 0
if new then
  local missing, shas, seen = {}, {}, {}
  for i = FIRST_FILE, #ARGV do
    local arg = ARGV[i]
    local written = string.sub(arg, 1, 1) == '+'
    local sha = written and string.sub(arg, 2) or arg
    if not seen[sha] then
      seen[sha] = true
      shas[#shas + 1] = sha
      if not redis.call('HGET', refs_key, sha) then
        local there = written
        if blob_prefix ~= '' then
          there = redis.call('EXISTS', blob_prefix .. sha) == 1
        end
        if not there then
          missing[#missing + 1] = sha
        end
      end
    end
  end
  if #missing > 0 then
    return {0, 'missing', 'files', table.concat(missing, ',')}
  end
  for _, sha in ipairs(shas) do
    redis.call('HINCRBY', refs_key, sha, 1)
    if blob_prefix ~= '' then
      redis.call('PERSIST', blob_prefix .. sha)
    end
  end
  redis.call('SET', tree_key, manifest)
end
redis.call('ZADD', jobs_key, ms, job_id)
redis.call('ZADD', trees_key, ms, tree)
return {1, 'attached', 'new', new and 1 or 0}

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_project_detach', callback=function(KEYS, ARGV)
-- project_detach: a job no longer refers to its project tree (deleted, cancelled, or its submit never
-- finished). With the tree's last job the tree goes, and each file no other tree holds: from the broker
-- here, from an object store by the caller (the reply names them).
--
-- project_detach(
--   keys = {tree manifest, tree's jobs zset, refs hash, trees zset},
--   args = {job id, tree digest, blob key prefix ('' for an object store)}
-- )
-- Reply: {1, 'kept'} (other jobs refer to it), {1, 'dropped', 'files', digests no tree holds now, joined by
-- ','} or {0, 'not attached'}.

local tree_key = KEYS[1]
local jobs_key = KEYS[2]
local refs_key = KEYS[3]
local trees_key = KEYS[4]

local job_id = ARGV[1]
local tree = ARGV[2]
local blob_prefix = ARGV[3]

if redis.call('ZREM', jobs_key, job_id) == 0 then
  return {0, 'not attached'}
end
if redis.call('ZCARD', jobs_key) > 0 then
  return {1, 'kept'}
end
local manifest = redis.call('GET', tree_key)
redis.call('DEL', tree_key)
redis.call('ZREM', trees_key, tree)
local gone, seen = {}, {}
if manifest then
  local ok, doc = pcall(cjson.decode, manifest)
  if ok and type(doc) == 'table' and type(doc.files) == 'table' then
    for _, entry in ipairs(doc.files) do
      local sha = type(entry) == 'table' and entry[2]
      if type(sha) == 'string' and not seen[sha] then
        seen[sha] = true
        local left = redis.call('HINCRBY', refs_key, sha, -1)
        if left <= 0 then
          redis.call('HDEL', refs_key, sha)
          if blob_prefix ~= '' then
            redis.call('DEL', blob_prefix .. sha)
          end
          gone[#gone + 1] = sha
        end
      end
    end
  end
end
return {1, 'dropped', 'files', table.concat(gone, ',')}

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_checkpoint', callback=function(KEYS, ARGV)
-- checkpoint: make an attempt's uploaded checkpoint the task's newest, fenced like a result.
--
-- checkpoint(
--   keys = {task hash, the upload (a hash of chunks with a TTL; in an object store: not a key, the index says
--           where), the task's checkpoint (the newest one kept, as chunks)},
--   args = {task id, lease token, this attempt's save number (rising), its index (JSON: store, bytes, sha256,
--           chunks, and for an object store its path)}
-- )
-- Only the primary copy that holds the lease saves (a backup copy's checkpoints are not kept: it restores the
-- primary's newest, and never one the primary has half uploaded, since an upload becomes the checkpoint here,
-- whole, in one step). A save older than the one kept (an earlier attempt's, or an earlier save of this one)
-- changes nothing. Reply: {1, 'saved', 'attempt', n, 'seq', s}; or {0, why} and the upload is dropped.

local task_key = KEYS[1]
local upload_key = KEYS[2]
local kept_key = KEYS[3]

local task_id = ARGV[1]
local token = ARGV[2]
local seq = tonumber(ARGV[3])
local index = ARGV[4]

local function refuse(why)
  if upload_key ~= '' then
    redis.call('DEL', upload_key)
  end
  return {0, why}
end

local copy, refused, _, t = holder(task_key, token, {'attempts', 'ckpt_lease', 'ckpt_seq'})
if not copy then
  return refuse(refused[2])
end
if copy ~= 'primary' then
  return refuse('backup')
end
-- The caller holds the lease now, so what is kept came from an earlier lease (older: replaced) or from this
-- one, whose saves must rise.
local attempt, lease = tonumber(t[4]) or 0, digest(token)
if not seq or (t[5] == lease and seq <= (tonumber(t[6]) or 0)) then
  return refuse('older')
end
if upload_key ~= '' then
  if redis.call('EXISTS', upload_key) == 0 then
    return {0, 'missing'}  -- its TTL ran out before the save was made the task's
  end
  redis.call('RENAME', upload_key, kept_key)
  redis.call('PERSIST', kept_key)
else
  redis.call('DEL', kept_key)  -- an object store holds it: the index alone says where
end
redis.call('HSET', task_key, 'ckpt_attempt', attempt, 'ckpt_lease', lease, 'ckpt_seq', seq, 'ckpt', index,
  'ckpt_at', secs(now_ms()))
return {1, 'saved', 'attempt', attempt, 'seq', seq}

end}
redis.register_function{function_name='gpumesh_c8c00f5014f4_read', callback=function(KEYS, ARGV)
-- read: the hashes of a page of tasks in one call, for readers of a job (results, as_completed, the dashboard):
-- a job of a million tasks is read a page per call, not a call per task. Read-only (registered 'no-writes').
--
-- read(
--   keys = {task hash, task hash, ...},
--   args = {}
-- )
-- Reply (see _lib.lua): {1, 'read', 'hashes', {the HGETALL of each key, in the order of KEYS; empty for one
-- that is gone}}.

local hashes = {}
for i, key in ipairs(KEYS) do
  hashes[i] = redis.call('HGETALL', key)
end
return {1, 'read', 'hashes', hashes}

end, flags={'no-writes'}}
redis.register_function{function_name='gpumesh_c8c00f5014f4_version', callback=function() return 'gpumesh_c8c00f5014f4' end, flags={'no-writes'}}
