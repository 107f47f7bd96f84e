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
local spent_key = KEYS[10]
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
  local fields = {'classes', 'key_id', 'timeout', 'submitter'}
  local job, J = redis.pcall('HMGET', job_key, unpack(fields)), at(fields)
  local klass = redis.pcall('HGET', task_key, 'class')
  if type(job) ~= 'table' or job.err or type(job[J.classes]) ~= 'string' then
    return nil
  end
  local ok, classes = pcall(cjson.decode, job[J.classes])
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
      if have and have >= most and accepts_signer(res, job[J.key_id]) and lender_accepts(res, job[J.timeout], job[J.submitter]) then
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
if r[2] == 'failed' and spent ~= '' and redis.call('SISMEMBER', spent_key, '*') == 1 then
  redis.call('SADD', spent_key, spent)  -- ended for good (only a signed job has the set)
end
return r
