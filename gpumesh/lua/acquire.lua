-- acquire: queued -> running. Only a queued task can be leased; any other delivery is skipped.
-- KEYS[1] task hash        KEYS[2] lease key     KEYS[3] leases zset    KEYS[4] job hash
-- KEYS[5] events stream    KEYS[6] worker hash   KEYS[7] queued zset
-- ARGV[1] task id          ARGV[2] worker id     ARGV[3] lease TTL (ms)
-- Returns {1, token, attempt, job id, index, payload, script sha, script name, timeout s,
--          max attempts, signature, key id, expires at (s), server time (ms)}
--      or {0, why}: why = 'missing' or the task's status.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return {0, 'missing'}
end
if status ~= 'queued' then
  return {0, status}
end
local ms = now_ms()
local ttl = tonumber(ARGV[3])
local attempt = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
local token = ARGV[2] .. ':' .. attempt .. ':' .. ms
redis.call('SET', KEYS[2], token, 'PX', ttl)
redis.call('ZADD', KEYS[3], ms + ttl, ARGV[1])
redis.call('ZREM', KEYS[7], ARGV[1])
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[2], 'lease', token, 'started_at', secs(ms))
move(KEYS[4], 'queued', 'running')
local job = redis.call('HMGET', KEYS[4], 'status', 'id', 'script_sha', 'script_name', 'timeout', 'key_id', 'expires_at')
if job[1] == 'queued' then
  redis.call('HSET', KEYS[4], 'status', 'running', 'started_at', secs(ms))
end
if redis.call('EXISTS', KEYS[6]) == 1 then
  redis.call('HSET', KEYS[6], 'current_task', ARGV[1])
end
emit(KEYS[5], 'task', ARGV[1], 'running')
local t = redis.call('HMGET', KEYS[1], 'index', 'payload', 'max_attempts', 'sig')
return {1, token, attempt, job[2], t[1], t[2], job[3], job[4], job[5], t[3], t[4] or '', job[6] or '', job[7] or '0', ms}
