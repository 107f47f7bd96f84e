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
local spent_key = KEYS[9]

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
if r[2] == 'failed' and spent ~= '' and redis.call('SISMEMBER', spent_key, '*') == 1 then
  redis.call('SADD', spent_key, spent)  -- ended for good (only a signed job has the set)
end
return r
