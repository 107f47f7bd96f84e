-- Helpers prepended to every gpumesh script by gpumesh/store/scripts.py (not a script of its own).
-- Time always comes from the server; workers' clocks never enter the state machine.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function secs(ms)
  return string.format('%.3f', ms / 1000)
end

local function emit(events_key, kind, id, status)
  redis.call('XADD', events_key, 'MAXLEN', '~', 10000, '*', 'kind', kind, 'id', id, 'status', status)
end

-- Move one task between job counters, in the same script as the task's own change.
local function move(job_key, from, to)
  redis.call('HINCRBY', job_key, from, -1)
  redis.call('HINCRBY', job_key, to, 1)
end

-- The last task to end sets the job's terminal status: cancelled > failed > done.
local function maybe_finish(job_key, events_key, job_id, ms)
  local c = redis.call('HMGET', job_key, 'queued', 'running', 'failed', 'cancelled', 'status')
  if tonumber(c[1]) > 0 or tonumber(c[2]) > 0 then
    return
  end
  local status = 'done'
  if tonumber(c[4]) > 0 then
    status = 'cancelled'
  elseif tonumber(c[3]) > 0 then
    status = 'failed'
  end
  if c[5] ~= status then
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
local function make_pending(task_key, job_key, ready_key, idle_key, job_id)
  local t = redis.call('HMGET', task_key, 'index', 'cost', 'class')
  local cost, klass = tonumber(t[2] or 1) or 1, t[3] or '0'
  redis.call('ZADD', pending_key(job_id, klass), cost, pad(t[1]))
  redis.call('ZADD', ready_key, tonumber(redis.call('HGET', job_key, 'priority') or 0) or 0, job_id .. '/' .. klass)
  redis.call('HINCRBYFLOAT', job_key, 'pending_cost', cost)
  wake_idle(idle_key)
end

-- A queued task leaves its pending zset (taken, or cancelled); the ready index drops a drained class.
-- index, cost, klass: the task's fields when the caller has them already (else read here).
local function unpend(task_key, job_key, ready_key, job_id, index, cost, klass)
  if index == nil then
    local t = redis.call('HMGET', task_key, 'index', 'cost', 'class')
    index, cost, klass = t[1], tonumber(t[2] or 1) or 1, t[3] or '0'
  end
  local pk = pending_key(job_id, klass)
  if redis.call('ZREM', pk, pad(index)) == 1 then
    redis.call('HINCRBYFLOAT', job_key, 'pending_cost', -cost)
  end
  if redis.call('EXISTS', pk) == 0 then
    redis.call('ZREM', ready_key, job_id .. '/' .. klass)
  end
end

-- The task fields take() needs, read in one call (status first, so callers can check it).
local TAKE_TASK = {'status', 'attempts', 'index', 'payload', 'sig'}
-- The job fields take() needs; dispatch reads them with what it chooses by, in one call.
local TAKE_JOB = {'status', 'id', 'script_sha', 'script_name', 'timeout', 'key_id', 'expires_at', 'max_attempts'}

-- queued -> running: the lease, the counters, the worker's current task. t: TAKE_TASK of the task;
-- job: TAKE_JOB of its job, or nil to read it here; worker_known: the worker hash exists.
-- Returns the lease reply:
-- {1, token, attempt, job id, index, payload, script sha, script name, timeout s, max attempts,
--  signature, key id, expires at (s), server time (ms), task id}
local function take(task_key, lease_key, leases_key, job_key, events_key, worker_key, task_id, worker_id, ttl, ms,
                    t, job, worker_known)
  local attempt = (tonumber(t[2]) or 0) + 1
  local token = worker_id .. ':' .. attempt .. ':' .. ms
  redis.call('SET', lease_key, token, 'PX', ttl)
  redis.call('ZADD', leases_key, ms + ttl, task_id)
  redis.call('HSET', task_key, 'status', 'running', 'attempts', attempt, 'worker', worker_id, 'lease', token,
    'started_at', secs(ms))
  move(job_key, 'queued', 'running')
  job = job or redis.call('HMGET', job_key, unpack(TAKE_JOB))
  if job[1] == 'queued' then
    redis.call('HSET', job_key, 'status', 'running', 'started_at', secs(ms))
  end
  if worker_known or redis.call('EXISTS', worker_key) == 1 then
    redis.call('HSET', worker_key, 'current_task', task_id)
  end
  emit(events_key, 'task', task_id, 'running')
  return {1, token, attempt, job[2], t[3], t[4], job[3], job[4], job[5], job[8], t[5] or '', job[6] or '',
    job[7] or '0', ms, task_id}
end

-- End a running attempt: back to 'queued' (pending again, idle workers woken) while attempts remain,
-- else 'failed'. Returns {'queued', attempts, 0} or {'failed', attempts, 0}.
-- refund: the attempt does not count (a worker handing its task back on shutdown).
-- final: fail for good whatever attempts remain.
local function end_attempt(task_key, job_key, events_key, ready_key, idle_key, stats_key, task_id, err, duration,
                           refund, ms, final)
  local attempts = tonumber(redis.call('HGET', task_key, 'attempts') or 0)
  local max_attempts = tonumber(redis.call('HGET', job_key, 'max_attempts') or 1)
  local job_id = job_of(task_id)
  if refund then
    attempts = redis.call('HINCRBY', task_key, 'attempts', -1)
  end
  if err ~= '' then
    redis.call('HSET', task_key, 'error', err)
  end
  if attempts < max_attempts and not final then
    redis.call('HSET', task_key, 'status', 'queued', 'lease', '')
    move(job_key, 'running', 'queued')
    make_pending(task_key, job_key, ready_key, idle_key, job_id)
    if not refund then
      redis.call('HINCRBY', stats_key, 'retried', 1)
    end
    emit(events_key, 'task', task_id, 'queued')
    return {'queued', attempts, 0}
  end
  redis.call('HSET', task_key, 'status', 'failed', 'lease', '', 'finished_at', secs(ms), 'duration', duration)
  move(job_key, 'running', 'failed')
  redis.call('HINCRBY', stats_key, 'failed', 1)
  emit(events_key, 'task', task_id, 'failed')
  maybe_finish(job_key, events_key, job_id, ms)
  return {'failed', attempts, 0}
end

-- Requirements (gpumesh/requirements.py has the same rules, tested against the same table).
-- reqs: list of {key, op, value}; res: the worker's resources (strings and numbers).
-- A decimal number or nil, as requirements.py reads one (strtod alone would take 'inf', 'nan', hex).
local function decimal(text)
  if string.find(text, '^%s*[-+]?[%d%.]+[eE]?[-+]?%d*%s*$') then
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
  if f[1] and f[4] ~= '1' then
    return tonumber(f[1]), tonumber(f[2]), tonumber(f[3]), f[5] or '0'
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
  return n, sum, max, f[5] or '0'
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
  redis.call('HINCRBY', hist_key, label, 1)
  redis.call('HINCRBYFLOAT', hist_key, 'sum', seconds)
  redis.call('HINCRBY', hist_key, 'count', 1)
end

-- Speculation: a running task may have one backup copy on a stronger idle worker (speculate.lua).
-- The lease fence of complete and fail: which copy `token` holds, 'primary' or 'backup'; or nil and
-- the refusal {0, why}, why = 'missing', the task's status, or 'stale' (another lease holds it now).
local function holder(task_key, token)
  local t = redis.call('HMGET', task_key, 'status', 'lease', 'backup')
  if not t[1] then
    return nil, {0, 'missing'}
  end
  if t[1] ~= 'running' then
    return nil, {0, t[1]}
  end
  if t[2] == token then
    return 'primary'
  end
  if t[3] and t[3] ~= '' and t[3] == token then
    return 'backup'
  end
  return nil, {0, 'stale'}
end

local function clear_backup(task_key)
  redis.call('HSET', task_key, 'backup', '', 'backup_worker', '', 'backup_until', 0)
end

-- The primary copy ended without a result (failed, handed back, or its lease lapsed): a live backup
-- becomes the primary, with the rest of its lease, and the task keeps running. Returns true if so.
local function promote_backup(task_key, lease_key, leases_key, task_id, ms)
  local b = redis.call('HMGET', task_key, 'backup', 'backup_worker', 'backup_until')
  local until_ms = tonumber(b[3] or 0) or 0
  if not b[1] or b[1] == '' or until_ms <= ms then
    return false
  end
  redis.call('HSET', task_key, 'lease', b[1], 'worker', b[2])
  clear_backup(task_key)
  redis.call('SET', lease_key, b[1], 'PX', until_ms - ms)
  redis.call('ZADD', leases_key, until_ms, task_id)
  return true
end

local function clear_current(worker_key, task_id)
  if redis.call('HGET', worker_key, 'current_task') == task_id then
    redis.call('HSET', worker_key, 'current_task', '')
  end
end
