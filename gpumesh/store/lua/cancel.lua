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
local spent_key = KEYS[7]

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
if spent ~= '' and redis.call('SISMEMBER', spent_key, '*') == 1 then
  redis.call('SADD', spent_key, spent)  -- only a signed job has one (made at submit, with its TTL)
end
emit(events_key, 'task', task_id, 'cancelled')
ended(job_key, task_id, 'cancelled')
maybe_finish(job_key, events_key, job_id, ms)
return {1, 'cancelled', 'previous', status}
