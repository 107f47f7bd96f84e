-- acquire: queued -> running for one named task (operators and tests; workers take work by dispatch.lua).
-- Only a queued task can be leased; anything else answers why not.
-- KEYS[1] task hash        KEYS[2] lease key     KEYS[3] leases zset    KEYS[4] job hash
-- KEYS[5] events stream    KEYS[6] worker hash   KEYS[7] ready zset
-- ARGV[1] task id          ARGV[2] worker id     ARGV[3] lease TTL (ms)
-- Returns take()'s lease reply (see _lib.lua), or {0, why}: why = 'missing' or the task's status.
local t = redis.call('HMGET', KEYS[1], unpack(TAKE_TASK))
if not t[1] then
  return {0, 'missing'}
end
if t[1] ~= 'queued' then
  return {0, t[1]}
end
unpend(KEYS[1], KEYS[4], KEYS[7], job_of(ARGV[1]))
return take(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[1], ARGV[2], tonumber(ARGV[3]), now_ms(), t)
