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
