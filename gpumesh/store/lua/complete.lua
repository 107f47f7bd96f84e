-- complete: running -> done, fenced by the lease token: a stale holder changes nothing. The token may
-- be the primary's or a backup copy's (speculation): the first fenced completion wins.
-- KEYS[1] task hash     KEYS[2] lease key     KEYS[3] leases zset   KEYS[4] job hash
-- KEYS[5] events stream KEYS[6] worker hash   KEYS[7] stats hash    KEYS[8] duration histogram hash
-- ARGV[1] task id       ARGV[2] lease token   ARGV[3] result (JSON) ARGV[4] duration (s)
-- ARGV[5] the completing worker's score (0: unknown), for the job's seconds-per-unit estimate
-- Returns {1, 'done'} or {0, why}: why = the task's status, 'missing' or 'stale' (another lease holds it).
local copy, refused = holder(KEYS[1], ARGV[2])
if not copy then
  return refused
end
local ms = now_ms()
if copy == 'backup' then
  redis.call('HINCRBY', KEYS[7], 'speculative_wins', 1)
end
clear_backup(KEYS[1])
redis.call('HSET', KEYS[1], 'status', 'done', 'result', ARGV[3], 'lease', '', 'error', '',
  'finished_at', secs(ms), 'duration', ARGV[4])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
move(KEYS[4], 'running', 'done')
local score = tonumber(ARGV[5] or 0) or 0
if score > 0 then  -- seconds per (cost / score): how the dispatcher's callers estimate a straggler's end
  local cost = tonumber(redis.call('HGET', KEYS[1], 'cost') or 1) or 1
  redis.call('HINCRBYFLOAT', KEYS[4], 'unit_sum', tonumber(ARGV[4]) * score / cost)
  redis.call('HINCRBY', KEYS[4], 'unit_n', 1)
end
redis.call('HINCRBY', KEYS[7], 'done', 1)
observe_duration(KEYS[8], tonumber(ARGV[4]))
clear_current(KEYS[6], ARGV[1])
emit(KEYS[5], 'task', ARGV[1], 'done')
maybe_finish(KEYS[4], KEYS[5], job_of(ARGV[1]), ms)
return {1, 'done'}
