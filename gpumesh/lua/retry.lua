-- retry: failed -> queued with a fresh set of attempts; the job opens again.
-- KEYS[1] task hash     KEYS[2] job hash      KEYS[3] events stream KEYS[4] queued zset
-- ARGV[1] task id
-- Returns {1, delivery, tier} or {0, status or 'missing'} for a task that is not failed.
local t = redis.call('HMGET', KEYS[1], 'status', 'tier')
if t[1] ~= 'failed' then
  return {0, t[1] or 'missing'}
end
local ms = now_ms()
local delivery = redis.call('HINCRBY', KEYS[1], 'deliveries', 1)
redis.call('HSET', KEYS[1], 'status', 'queued', 'attempts', 0, 'lease', '')
redis.call('HDEL', KEYS[1], 'finished_at', 'duration')
redis.call('ZADD', KEYS[4], ms, ARGV[1])
move(KEYS[2], 'failed', 'queued')
local job = redis.call('HMGET', KEYS[2], 'status', 'id')
if job[1] == 'done' or job[1] == 'failed' or job[1] == 'cancelled' then
  redis.call('HSET', KEYS[2], 'status', 'running')
  redis.call('HDEL', KEYS[2], 'finished_at')
  emit(KEYS[3], 'job', job[2], 'running')
end
emit(KEYS[3], 'task', ARGV[1], 'queued')
return {1, delivery, tonumber(t[2])}
