-- retry: failed -> queued with a fresh set of attempts; the job opens again.
-- KEYS[1] task hash     KEYS[2] job hash      KEYS[3] events stream KEYS[4] ready zset
-- KEYS[5] idle set
-- ARGV[1] task id
-- Returns {1, 0, 0} or {0, status or 'missing'} for a task that is not failed.
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'failed' then
  return {0, status or 'missing'}
end
local job_id = job_of(ARGV[1])
redis.call('HSET', KEYS[1], 'status', 'queued', 'attempts', 0, 'lease', '')
redis.call('HDEL', KEYS[1], 'finished_at', 'duration')
move(KEYS[2], 'failed', 'queued')
make_pending(KEYS[1], KEYS[2], KEYS[4], KEYS[5], job_id)
local job = redis.call('HMGET', KEYS[2], 'status', 'id')
if job[1] == 'done' or job[1] == 'failed' or job[1] == 'cancelled' then
  redis.call('HSET', KEYS[2], 'status', 'running')
  redis.call('HDEL', KEYS[2], 'finished_at')
  emit(KEYS[3], 'job', job[2], 'running')
end
emit(KEYS[3], 'task', ARGV[1], 'queued')
return {1, 0, 0}
