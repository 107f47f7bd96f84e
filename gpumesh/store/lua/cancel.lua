-- cancel: queued|running -> cancelled. A running task's worker learns it at its next heartbeat.
-- KEYS[1] task hash     KEYS[2] lease key     KEYS[3] leases zset   KEYS[4] job hash
-- KEYS[5] events stream KEYS[6] ready zset
-- ARGV[1] task id
-- Returns {1, previous status} or {0, status or 'missing'} when already ended.
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'running' then
  return {0, status or 'missing'}
end
local ms = now_ms()
local job_id = job_of(ARGV[1])
if status == 'queued' then
  unpend(KEYS[1], KEYS[4], KEYS[6], job_id)
end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'lease', '', 'finished_at', secs(ms))
clear_backup(KEYS[1])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
move(KEYS[4], status, 'cancelled')
emit(KEYS[5], 'task', ARGV[1], 'cancelled')
maybe_finish(KEYS[4], KEYS[5], job_id, ms)
return {1, status}
