-- Helpers shared by every gpumesh script, defined once at the top of the library by gpumesh/store/scripts.py
-- (not a script of its own).
-- Time always comes from the server; workers' clocks never enter the state machine.
--
-- The contract every script keeps:
--  * KEYS and ARGV are named once, in a block of locals at the top of the script, under a header
--    comment listing them in order (as dramatiq's dispatch.lua does); nothing below that block
--    indexes KEYS or ARGV. A script may put constant tables and pure functions above a line
--    '-- per call' (before that block): they are made once, when the library loads (scripts.py), and
--    may call only Lua itself (no unpack or ipairs there).
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

-- Numbers reach Redis as text. A Lua number handed to redis.call is formatted with '%.17g', and one joined to
-- a string with '..' with '%.14g': C's floating-point formatting, thousands of instructions each, a tenth of
-- what a task cost the broker before the hot paths below passed text. So an integer goes through int()
-- (C's integer formatting), constant arguments are written as text, and secs() formats with integers too.
local function int(n)
  return string.format('%d', n)
end

-- Epoch ms as seconds with three decimals (what '%.3f' of ms / 1000 gives, for the whole ms the server's clock reads).
local function secs(ms)
  return string.format('%d.%03d', math.floor(ms / 1000), ms % 1000)
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
  redis.call('XADD', events_key, 'MAXLEN', '~', '10000', '*', 'kind', kind, 'id', id, 'status', status)
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
  local text = by  -- a float as Lua formats it (full precision); an integer as text (see int)
  if not float then
    text = by == 1 and '1' or by == -1 and '-1' or int(by)
  end
  local r = redis.pcall(float and 'HINCRBYFLOAT' or 'HINCRBY', key, field, text)
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
-- it looks (as dramatiq's dispatch.lua builds its queue keys). They mirror gpumesh/store/keys.py exactly;
-- PREFIX is keys.PREFIX, defined above this file by scripts.py when it assembles the library.

local function job_of(task_id)
  return string.match(task_id, '^(.*)%-%d+$')
end

local function pending_key(job_id, klass)
  return PREFIX .. 'job:' .. job_id .. ':pending:' .. klass
end

-- keys.spent: the spent set of a task's job (signing.py).
local function spent_key_of(task_id)
  return PREFIX .. 'spent:' .. (job_of(task_id) or '')
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

-- Tiers. A worker's tier is its rank among the registered workers' scores (keys.SCORES, ordered by score,
-- then id), spread over 0 (weakest) .. tiers - 1, rounded half up; a lone worker is in the top tier.
-- gpumesh/scheduling.py's worker_tiers computes the same. Each tier has an RQ queue, gpumesh-tier-<k>: the
-- deliveries of the workers of that tier go through it, and a window of the tasks placed for that tier
-- waits in it (refresh_window, in dispatch.lua's section below). They mirror gpumesh/store/keys.py.
local TIER_QUEUE = 'rq:queue:gpumesh-tier-'

local function tier_of(scores_key, worker_id, n, tiers)
  local rank = redis.call('ZRANK', scores_key, worker_id)
  if n <= 1 or not rank then
    return tiers - 1
  end
  return math.floor((2 * rank * (tiers - 1) + (n - 1)) / (2 * (n - 1)))
end

-- A queued task that waits in a tier's window leaves it (it was taken, or cancelled): its RQ entry
-- '<task>_waiting' goes from the queue, and its RQ job with it.
local function unplace(task_key, task_id, tier)
  local id = task_id .. '_waiting'
  redis.pcall('LREM', TIER_QUEUE .. tier, 0, id)  -- pcall: any credential may write RQ's keys
  redis.call('DEL', 'rq:job:' .. id)
  redis.pcall('HDEL', task_key, 'tier')
end

-- A queued task leaves its pending zset (taken, or cancelled); the ready index drops a drained class.
-- a: {task_key, job_key, ready_key, job_id, and optionally index, cost, klass, tier: the task's fields when
-- the caller has them already (else read here; tier false or '' when it waits in no tier's window);
-- remains: the caller saw another member in the set}
local function unpend(a)
  local index, cost, klass, tier = a.index, a.cost, a.klass, a.tier
  if index == nil then
    local t = redis.call('HMGET', a.task_key, 'index', 'cost', 'class', 'tier')
    index, cost, klass, tier = t[1], tonumber(t[2] or 1) or 1, t[3] or '0', t[4]
  end
  if type(tier) == 'string' and tier ~= '' then
    unplace(a.task_key, a.job_id .. '-' .. int(index), tier)
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
    local got = redis.pcall('SMISMEMBER', spent_key_of(l.task_id), '*', index)
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
  if l.tier then  -- dispatch: the worker's tier as the fleet was when it asked
    r[n + 1], r[n + 2] = 'tier', l.tier
    n = n + 2
  end
  if l.backup then
    r[n + 1], r[n + 2], r[n + 3], r[n + 4] = 'backup', 1, 'backup_mode', l.backup_mode
  end
  return r
end

-- The task fields take() needs, read in one call (status first, so callers can check it).
local TAKE_TASK = {'status', 'attempts', 'index', 'payload', 'sig', 'tier', 'log_from'}  -- tier: unpend's
-- Where each of ``fields`` sits in an HMGET reply of them, by name: reply[at(fields).name] is that field's value.
local function at(fields)
  local pos = {}
  for i = 1, #fields do  -- no ipairs: the library's loading code may call only Lua itself
    pos[fields[i]] = i
  end
  return pos
end

-- The job fields take() needs; dispatch reads them with what it chooses by, in one call.
local TAKE_JOB = {'status', 'id', 'script_sha', 'script_name', 'timeout', 'key_id', 'expires_at', 'max_attempts'}
local TAKE_TASK_AT = at(TAKE_TASK)
local TAKE_JOB_AT = at(TAKE_JOB)

-- queued -> running: the lease, the counters, the worker's current task. Returns lease_reply.
-- a: {task_key, lease_key, leases_key, job_key, events_key, worker_key, task_id, worker_id, ttl_ms, ms,
--     token: the lease token the worker made (only its digest is stored),
--     task: the HMGET of TAKE_TASK of the task,
--     job: an HMGET reply holding TAKE_JOB of its job, with job_at its fields' positions (at()), or nil to
--          read it here,
--     worker_known: the worker hash exists (else checked here),
--     fleet_version, tier: passed on to lease_reply}
local function take(a)
  local ms, ttl_ms, task_id, worker_id = a.ms, a.ttl_ms, a.task_id, a.worker_id
  local t = a.task
  local attempt, index, payload, signature = (tonumber(t[2]) or 0) + 1, t[3], t[4], t[5]
  local token = digest(a.token)
  redis.call('SET', a.lease_key, token, 'PX', int(ttl_ms))
  redis.call('ZADD', a.leases_key, int(ms + ttl_ms), task_id)
  if attempt == 1 and not t[TAKE_TASK_AT.log_from] then
    -- Where its lines begin in its job's log (gpumesh/store/tasklog.py): kept through a retry, whose attempts
    -- count again from 1, so that the task's log reads from its first attempt.
    redis.call('HSET', a.task_key, 'status', 'running', 'attempts', int(attempt), 'worker', worker_id, 'lease', token,
      'started_at', secs(ms), 'promoted', '', 'log_from', int(ms))
  else
    redis.call('HSET', a.task_key, 'status', 'running', 'attempts', int(attempt), 'worker', worker_id, 'lease', token,
      'started_at', secs(ms), 'promoted', '')
  end
  move(a.job_key, 'queued', 'running')
  local job, J = a.job, a.job_at
  if not job then
    job, J = redis.call('HMGET', a.job_key, unpack(TAKE_JOB)), TAKE_JOB_AT
  end
  if job[J.status] == 'queued' then
    redis.call('HSET', a.job_key, 'status', 'running', 'started_at', secs(ms))
  end
  if a.worker_known or redis.call('EXISTS', a.worker_key) == 1 then
    redis.call('HSET', a.worker_key, 'current_task', task_id)
  end
  emit(a.events_key, 'task', task_id, 'running')
  return lease_reply({
    task_id = task_id, attempt = attempt, job_id = job[J.id], index = index, payload = payload,
    script_sha = job[J.script_sha], script_name = job[J.script_name], timeout = job[J.timeout],
    key_id = job[J.key_id], expires_at = job[J.expires_at], max_attempts = job[J.max_attempts],
    signature = signature, server_ms = ms,
    fleet_version = a.fleet_version, tier = a.tier,
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
-- dispatcher must not walk a thousand workers per task). Returns n, score sum, score max, version, and the
-- HMGET's reply, whose fields from position 6 on are those of ``more`` (read in the same call).
local function fleet(scores_key, fleet_key, more)
  local f = redis.call('HMGET', fleet_key, 'n', 'sum', 'max', 'dirty', 'v', unpack(more or {}))
  local count, total, strongest, dirty, version = tonumber(f[1]), tonumber(f[2]), tonumber(f[3]), f[4], f[5] or '0'
  if count and total and strongest and dirty ~= '1' then  -- else recount (never yet counted, or not numbers)
    return count, total, strongest, version, f
  end
  local all = redis.call('ZRANGE', scores_key, 0, -1, 'WITHSCORES')
  local n, sum, max = 0, 0, 0
  for i = 2, #all, 2 do
    local s = tonumber(all[i])
    n = n + 1
    sum = sum + s
    if s > max then max = s end
  end
  redis.call('HSET', fleet_key, 'n', n, 'sum', sum, 'max', max, 'dirty', '0')
  -- A recount is a new fleet, whoever marked it dirty: its version moves too, so that what callers keep per
  -- version (dispatch's tier of each worker) is computed again.
  version = int(incr(fleet_key, 'v', 1))
  return n, sum, max, version, f
end

-- Upper bounds (s) of the task duration histogram; gpumesh/server/metrics.py reads the same list.
local DURATION_BUCKETS = {0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 3600}

local DURATION_LABELS = {'0.1', '0.5', '1', '5', '10', '30', '60', '300', '1800', '3600'}  -- as tostring() writes each

local function observe_duration(hist_key, seconds)
  local label = '+Inf'
  for i, le in ipairs(DURATION_BUCKETS) do
    if seconds <= le then
      label = DURATION_LABELS[i]
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

-- Environments (gpumesh/envs): a worker names in its hash the envs its machine holds ready ('envs') and those
-- whose build failed there ('env_failed'), each a comma-separated list of lock digests cut to ENV_SHORT
-- characters. A job with an env records in 'env_dead' that a build failed: '0' while some live worker that may
-- run the job has not failed it, '1' once none has (env_failed.lua).
local ENV_SHORT = 16
local function env_listed(list, digest)
  if type(list) ~= 'string' or type(digest) ~= 'string' or digest == '' then
    return false
  end
  return string.find(',' .. list .. ',', ',' .. string.sub(digest, 1, ENV_SHORT) .. ',', 1, true) ~= nil
end

-- What a worker may do with a job whose env is ``digest`` ('' or nil: none): 'run' its tasks (no env, or its
-- machine holds it); 'prepare' it first (it lacks it, or it failed here and this job has not heard so yet:
-- preparing again fails at once and tells the job); 'wait' for other workers (it failed here, and some other
-- worker may build it); or 'run' to fail them (it failed everywhere: the task fails with the builder's message).
local function env_state(held, failed, digest, dead)
  if type(digest) ~= 'string' or digest == '' or env_listed(held, digest) then
    return 'run'
  end
  if not env_listed(failed, digest) or (dead ~= '0' and dead ~= '1') then
    return 'prepare'
  end
  return dead == '1' and 'run' or 'wait'
end

-- The zset of the workers whose machines hold env (or project tree) ``digest``, by score (env_held.lua).
local function env_holders(digest)
  return PREFIX .. 'envholders:' .. string.sub(digest, 1, ENV_SHORT)
end

-- The score of the strongest live worker that holds env (or tree) ``digest``, at most ``fleet_max`` (the fleet's); the
-- fleet's when none is known. Holders gone since are dropped on the way.
local function env_strongest(digest, fleet_max)
  local key = env_holders(digest)
  for _ = 1, 4 do
    local top = redis.pcall('ZREVRANGE', key, '0', '0', 'WITHSCORES')
    if type(top) ~= 'table' or top.err or not top[1] then
      return fleet_max
    end
    if redis.call('EXISTS', PREFIX .. 'worker:' .. top[1]) == 1 then
      return math.min(tonumber(top[2]) or fleet_max, fleet_max)
    end
    redis.call('ZREM', key, top[1])
  end
  return fleet_max
end

-- A tier's window: the tasks placed for a tier wait in its RQ queue, gpumesh-tier-<k>, as RQ jobs
-- '<task>_waiting' (what rq-dashboard and `rq info` count and list), at most TIER_WINDOW of them. The
-- dispatcher refreshes a tier's window as one of its workers takes a task, at most once every
-- TIER_REFRESH_MS per tier: the next tasks the placement rule gives that worker from the same job, in the
-- order it takes them (within its horizon heaviest first; a lone worker's, lightest first). A task in
-- another tier's window stays there; the entries no longer among the next ones leave. An entry is only
-- shown: no worker pops it. A worker's delivery goes to the front of its tier's queue and is popped in
-- the same transaction, so nothing waits behind an entry that a worker of the tier cannot run, and a
-- task leaving its pending set (taken, cancelled) leaves its window (unpend, unplace). An entry's RQ job
-- expires after TIER_ENTRY_TTL unless a refresh keeps it.
local TIER_WINDOW, TIER_REFRESH_MS, TIER_ENTRY_TTL = 20, 1000, 3600

-- Whether a tier's window last refreshed at ``at`` (ms, the fleet hash's 'at:<tier>') is due again at ``ms``: not
-- within TIER_REFRESH_MS of it; a time ahead of now, which any worker credential may write, counts as none.
local function window_due(at, ms)
  local since = ms - (tonumber(at) or 0)
  return since < 0 or since >= TIER_REFRESH_MS
end

local refresh_window
do
  local EXECUTOR = 'gpumesh.executor.run_task'  -- gpumesh/store/broker.py's EXECUTOR: the RQ function named

  -- Epoch ms as RQ writes its times (utcformat): 2026-12-07T10:40:00.123000Z
  local function rq_time(ms)
    local s = math.floor(ms / 1000)
    local days = math.floor(s / 86400)
    local rem = s - days * 86400
    local z = days + 719468  -- days from 0000-03-01 (H. Hinnant's civil_from_days)
    local era = math.floor(z / 146097)
    local doe = z - era * 146097
    local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
    local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
    local mp = math.floor((5 * doy + 2) / 153)
    local d = doy - math.floor((153 * mp + 2) / 5) + 1
    local m = mp < 10 and mp + 3 or mp - 9
    local y = yoe + era * 400 + (m <= 2 and 1 or 0)
    return string.format('%04d-%02d-%02dT%02d:%02d:%02d.%06dZ', y, m, d, math.floor(rem / 3600),
      math.floor(rem % 3600 / 60), rem % 60, (ms % 1000) * 1000)
  end

  -- Write one entry's RQ job (as RQ's Job.save writes a queued job; its data uncompressed JSON, which RQ
  -- reads too), and mark its task placed for the tier.
  local function enter(a, index, cost)
    local task_id = a.job_id .. '-' .. index
    local id = task_id .. '_waiting'
    local key = 'rq:job:' .. id
    local label = a.name ~= '' and ('job "' .. a.name .. '" (' .. a.job_id .. ')') or ('job ' .. a.job_id)
    local when = rq_time(a.ms)
    redis.call('DEL', key)  -- whatever a credential wrote under this id (a string would fail HSET, stranding the task)
    redis.call('HSET', key, 'data', cjson.encode({EXECUTOR, cjson.null, {task_id}, {}}), 'created_at', when,
      'enqueued_at', when, 'origin', 'gpumesh-tier-' .. a.tier, 'status', 'queued', 'ttl', TIER_ENTRY_TTL,
      'description', 'task ' .. index .. ' of ' .. label .. ': placed for tier ' .. a.tier .. ', cost ' ..
        cost .. '; waiting (this queue lists the next ' .. TIER_WINDOW .. ' at most: `gpumesh workers` ' ..
        'shows every queued task by tier)',
      'meta', cjson.encode({job = a.name, job_id = a.job_id, task_id = task_id, task_index = tonumber(index),
        cost = tonumber(cost), tier = tonumber(a.tier), waiting = true}))
    redis.call('EXPIRE', key, TIER_ENTRY_TTL)
    redis.pcall('HSET', PREFIX .. 'task:' .. task_id, 'tier', a.tier)
  end

  -- a: {tier, at: when its window was last refreshed (the fleet hash's 'at:<tier>', read by fleet()), fleet_key,
  --     job_id, job_key, pk: the pending zset the worker took from, limit: its horizon's cost limit
  --     (nil: a lone worker, lightest first), below: the heaviest cost when a stronger worker is registered
  --     (left to it while lighter tasks are there, as dispatch.lua picks), ms: the time now}
  refresh_window = function(a)
    if not window_due(a.at, a.ms) then
      return  -- refreshed a moment ago
    end
    redis.call('HSET', a.fleet_key, 'at:' .. a.tier, a.ms)
    local next = {}
    if a.limit and a.below and tonumber(a.below) <= a.limit then  -- the heaviest cost is the strongest's
      next = redis.call('ZREVRANGEBYSCORE', a.pk, '(' .. a.below, '-inf', 'WITHSCORES', 'LIMIT', 0, 2 * TIER_WINDOW)
    end
    if a.limit and #next == 0 then
      next = redis.call('ZREVRANGEBYSCORE', a.pk, a.limit, '-inf', 'WITHSCORES', 'LIMIT', 0, 2 * TIER_WINDOW)
    end
    if #next == 0 then
      next = redis.call('ZRANGE', a.pk, 0, 2 * TIER_WINDOW - 1, 'WITHSCORES')
    end
    local qkey = TIER_QUEUE .. a.tier
    local listed = redis.pcall('LRANGE', qkey, 0, -1)
    if type(listed) ~= 'table' or listed.err then
      return  -- not a list (some credential wrote it): no window, and dispatch goes on
    end
    local kept, has = {}, {}
    for _, id in ipairs(listed) do
      has[id] = true
    end
    local add, order = {}, {}  -- entries to write; every entry of the window, in the order the tier takes them
    for i = 1, #next, 2 do
      if #order >= TIER_WINDOW then
        break
      end
      local index = tonumber(next[i])
      if index then
        local task_id = a.job_id .. '-' .. index
        local id = task_id .. '_waiting'
        local placed = redis.pcall('HGET', PREFIX .. 'task:' .. task_id, 'tier')
        if type(placed) ~= 'string' then
          placed = false  -- none, or not a hash
        end
        if has[id] and placed == tostring(a.tier) and redis.call('EXPIRE', 'rq:job:' .. id, TIER_ENTRY_TTL) == 1 then
          kept[id] = true
          order[#order + 1] = id
        elseif not placed or placed == '' or placed == tostring(a.tier) then
          add[#add + 1] = {index, next[i + 1]}
          order[#order + 1] = id
        end
      end
    end
    for id in pairs(has) do
      if not kept[id] then  -- no longer among the next: out of the window
        local task_id = string.match(id, '^(.*)_waiting$')
        if task_id then
          unplace(PREFIX .. 'task:' .. task_id, task_id, a.tier)
        else
          redis.call('LREM', qkey, 0, id)  -- not an entry of ours
        end
      end
    end
    if #add > 0 then
      local name = redis.pcall('HGET', a.job_key, 'name')
      a.name = type(name) == 'string' and string.sub(name, 1, 200) or ''
      for _, e in ipairs(add) do
        enter(a, tonumber(e[1]), e[2])
      end
    end
    redis.call('DEL', qkey)
    if #order > 0 then
      redis.call('RPUSH', qkey, unpack(order))
      redis.call('SADD', 'rq:queues', qkey)
    end
  end
end
