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
local spent_key = KEYS[6]  -- declared, for ACLs and Redis Cluster; the name used is the task's own (below)

local task_id = ARGV[1]
local cancelled_too = ARGV[2] == '1'
local spent = ARGV[3] or ''

local status = redis.call('HGET', task_key, 'status')
if status ~= 'failed' and not (cancelled_too and status == 'cancelled') then
  return {0, status or 'missing'}
end
-- First: see above (a no-op for an unsigned job). The set's name is made here from the task id, not taken
-- from KEYS, so a caller cannot skip this step by naming another key.
redis.call('SREM', spent_key_of(task_id), spent)
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
