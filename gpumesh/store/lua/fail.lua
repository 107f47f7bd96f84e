-- fail: running -> queued (attempts left) or failed; fenced by the lease token.
-- KEYS[1] task hash     KEYS[2] lease key     KEYS[3] leases zset   KEYS[4] job hash
-- KEYS[5] events stream KEYS[6] worker hash   KEYS[7] ready zset    KEYS[8] stats hash
-- KEYS[9] idle set
-- ARGV[1] task id       ARGV[2] lease token   ARGV[3] error text    ARGV[4] duration (s)
-- ARGV[5] 'fail'; 'release' to hand the task back without spending an attempt; 'reject' to fail it
--         for good whatever attempts remain (a task that must never run, such as a bad signature)
-- Returns {1, 'queued', attempts, 0} | {1, 'failed', attempts, 0} | {0, why} as complete.lua,
--      or {1, 'running', 0, 0} when the task runs on: a backup copy ended (it is dropped), or the
--      primary ended while a live backup runs (the backup becomes the primary).
local copy, refused = holder(KEYS[1], ARGV[2])
if not copy then
  return refused
end
local ms = now_ms()
clear_current(KEYS[6], ARGV[1])
local tier = 0
if copy == 'backup' then
  clear_backup(KEYS[1])
  return {1, 'running', 0, tier}
end
if ARGV[5] ~= 'reject' and promote_backup(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ms) then
  if ARGV[3] ~= '' then
    redis.call('HSET', KEYS[1], 'error', ARGV[3])
  end
  return {1, 'running', 0, tier}
end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
clear_backup(KEYS[1])
local r = end_attempt(KEYS[1], KEYS[4], KEYS[5], KEYS[7], KEYS[9], KEYS[8], ARGV[1], ARGV[3], ARGV[4],
  ARGV[5] == 'release', ms, ARGV[5] == 'reject')
return {1, r[1], r[2], r[3]}
