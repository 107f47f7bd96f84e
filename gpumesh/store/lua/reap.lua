-- reap: a running task whose lease key has lapsed goes back to queued (or failed at max_attempts),
-- unless a live backup copy runs it: that copy becomes the primary.
-- KEYS[1] task hash     KEYS[2] lease key     KEYS[3] leases zset   KEYS[4] job hash
-- KEYS[5] events stream KEYS[6] ready zset      KEYS[7] stats hash    KEYS[8] idle set
-- ARGV[1] task id
-- Returns {'renewed'} (lease still alive), {'gone'} (not running), or end_attempt's {'queued'|'failed', attempts, 0}
local t = redis.call('HMGET', KEYS[1], 'status', 'worker')
local ms = now_ms()
if t[1] ~= 'running' then
  redis.call('ZREM', KEYS[3], ARGV[1])
  return {'gone'}
end
local pttl = redis.call('PTTL', KEYS[2])
if pttl > 0 then
  redis.call('ZADD', KEYS[3], ms + pttl, ARGV[1])
  return {'renewed'}
end
if promote_backup(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ms) then
  return {'renewed'}  -- the primary is gone, its live backup carries on as the primary
end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
clear_backup(KEYS[1])
local err = 'lease expired: worker ' .. (t[2] or '?') .. ' stopped heartbeating'
redis.call('HINCRBY', KEYS[7], 'lease_expired', 1)
return end_attempt(KEYS[1], KEYS[4], KEYS[5], KEYS[6], KEYS[8], KEYS[7], ARGV[1], err, '', false, ms)
