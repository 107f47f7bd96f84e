-- speculate: start a backup copy of a running task on a stronger worker (a straggler's twin).
-- Allowed when the task's job allows it (the default; submit --no-speculate turns it off), the task has
-- no live backup, this worker is at least ARGV[5] times as strong as the primary's, and either
--   mode 'idle': the job has nothing left queued (the end of a job, this worker found nothing else), or
--   mode 'straggler': the caller found the primary would end long after the rest of the work (a much
--   stronger worker joined after a weak one took a heavy task); the job may still have queued tasks.
-- The first fenced completion of either copy wins (complete.lua); the other learns 'lost' at its
-- next heartbeat and is killed. A backup does not spend an attempt.
-- KEYS[1] task hash     KEYS[2] job hash      KEYS[3] worker hash   KEYS[4] scores zset
-- KEYS[5] stats hash
-- ARGV[1] task id       ARGV[2] worker id     ARGV[3] lease TTL (ms)   ARGV[4] this worker's score
-- ARGV[5] minimum speed-up over the primary's worker                 ARGV[6] 'idle' or 'straggler'
-- Returns take()'s lease reply (see _lib.lua) or {0, why}.
local t = redis.call('HMGET', KEYS[1], 'status', 'worker', 'backup', 'backup_until', 'attempts', 'index', 'payload',
  'sig', 'class')
if t[1] ~= 'running' then
  return {0, t[1] or 'missing'}
end
if t[2] == ARGV[2] then
  return {0, 'own task'}
end
local ms = now_ms()
if t[3] and t[3] ~= '' and tonumber(t[4] or 0) > ms then
  return {0, 'has a backup'}
end
local job = redis.call('HMGET', KEYS[2], 'speculate', 'queued', 'id', 'script_sha', 'script_name', 'timeout',
  'key_id', 'expires_at', 'max_attempts', 'classes')
if job[1] ~= '1' then
  return {0, 'not speculative'}
end
local raw = redis.call('HGET', KEYS[3], 'resources')
local reqs = cjson.decode(job[10] or '[[]]')[tonumber(t[9] or 0) + 1] or {}
if not meets_all(reqs, raw and cjson.decode(raw) or {}) then
  return {0, 'requirements not met'}
end
if ARGV[6] ~= 'straggler' and tonumber(job[2]) > 0 then
  return {0, 'job has queued tasks'}
end
local primary = tonumber(redis.call('ZSCORE', KEYS[4], t[2]) or 0)
if primary > 0 and tonumber(ARGV[4]) < primary * tonumber(ARGV[5]) then
  return {0, 'not faster'}
end
local token = ARGV[2] .. ':backup:' .. t[5] .. ':' .. ms
redis.call('HSET', KEYS[1], 'backup', token, 'backup_worker', ARGV[2], 'backup_until', ms + tonumber(ARGV[3]),
  'backup_mode', ARGV[6], 'backup_started_at', secs(ms))
redis.call('HINCRBY', KEYS[5], 'speculated', 1)
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HSET', KEYS[3], 'current_task', ARGV[1])
end
return {1, token, tonumber(t[5]), job[3], t[6], t[7], job[4], job[5], job[6], job[9], t[8] or '', job[7] or '',
  job[8] or '0', ms, ARGV[1]}
