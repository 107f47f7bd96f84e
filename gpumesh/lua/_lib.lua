-- Helpers prepended to every gpumesh script by gpumesh/scripts.py (not a script of its own).
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

-- End a running attempt: back to 'queued' (and into the queued set the reaper audits) while attempts
-- remain, else 'failed'.
-- Returns {'queued', delivery number, tier} or {'failed', attempts, tier}.
-- refund: the attempt does not count (a worker handing its task back on shutdown).
-- final: fail for good whatever attempts remain.
local function end_attempt(task_key, job_key, events_key, queued_key, stats_key, task_id, err, duration, refund, ms, final)
  local t = redis.call('HMGET', task_key, 'attempts', 'max_attempts', 'tier', 'job')
  local attempts, max_attempts = tonumber(t[1]), tonumber(t[2])
  if refund then
    attempts = redis.call('HINCRBY', task_key, 'attempts', -1)
  end
  if err ~= '' then
    redis.call('HSET', task_key, 'error', err)
  end
  if attempts < max_attempts and not final then
    -- each requeue is a new delivery with its own deterministic RQ job id (<task>_<delivery>)
    local delivery = redis.call('HINCRBY', task_key, 'deliveries', 1)
    redis.call('HSET', task_key, 'status', 'queued', 'lease', '')
    redis.call('ZADD', queued_key, ms, task_id)
    move(job_key, 'running', 'queued')
    if not refund then
      redis.call('HINCRBY', stats_key, 'retried', 1)
    end
    emit(events_key, 'task', task_id, 'queued')
    return {'queued', delivery, tonumber(t[3])}
  end
  redis.call('HSET', task_key, 'status', 'failed', 'lease', '', 'finished_at', secs(ms), 'duration', duration)
  move(job_key, 'running', 'failed')
  redis.call('HINCRBY', stats_key, 'failed', 1)
  emit(events_key, 'task', task_id, 'failed')
  maybe_finish(job_key, events_key, t[4], ms)
  return {'failed', attempts, tonumber(t[3])}
end

-- Upper bounds (s) of the task duration histogram; gpumesh/metrics.py reads the same list.
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
