-- complete: running -> done, fenced by the lease token: a stale holder changes nothing. The token may
-- be the primary's or a backup copy's (speculation): the first fenced completion wins.
--
-- complete(
--   keys = {task hash, lease key, leases zset, job hash, events stream, worker hash, stats hash,
--           duration histogram hash, staged files hash, task files hash, the job's spent set},
--   args = {task id, lease token (the plain token: its digest is what the task holds), result (JSON), duration (s),
--           the completing worker's score (0: unknown), for the job's seconds-per-unit estimate,
--           artifact index (JSON, '' for none), its bytes, its object store URL ('' = the broker),
--           1 when the staged files hash is to become the task's files (broker-stored artifacts),
--           this task's member in the spent set ('' = none: not a signed task), then field/value pairs
--           stored with the result (the worker's result proof, signing.py)}
-- )
-- The winner's output files are kept in the same step as its result: a losing copy's stay staged and
-- expire (store/artifacts.py).
-- Reply (see _lib.lua): {1, 'done'} (also for a repeat of the winning call), or {0, why}: why = the task's status, 'missing' or 'stale'
-- (another lease holds it).

local task_key = KEYS[1]
local lease_key = KEYS[2]
local leases_key = KEYS[3]
local job_key = KEYS[4]
local events_key = KEYS[5]
local worker_key = KEYS[6]
local stats_key = KEYS[7]
local histogram_key = KEYS[8]
local staged_key = KEYS[9]
local files_key = KEYS[10]

local task_id = ARGV[1]
local token = ARGV[2]
local result = ARGV[3]
local duration = ARGV[4]  -- kept as sent ('%.3f'), stored as is
local score = tonumber(ARGV[5] or 0) or 0
local artifacts = ARGV[6] or ''
local artifact_bytes = tonumber(ARGV[7] or 0) or 0
local artifact_store = ARGV[8] or ''
local promote = ARGV[9] == '1'
local spent_key, spent = KEYS[11], ARGV[10] or ''

-- In one read: the fence's fields (t[1..3]), the primary's attempt record (t[4..8]) and the cost (t[9]).
local read = {unpack(ATTEMPT_FIELDS.primary)}
read[6] = 'cost'
local copy, refused, has_backup, t = holder(task_key, token, read)
if not copy then
  -- The same completion again (its first reply was lost and the call retried): it did win.
  if refused[2] == 'done' and token ~= '' and redis.call('HGET', task_key, 'done_token') == done_token(token) then
    return {1, 'done'}
  end
  return refused
end
local ms = now_ms()
if copy == 'backup' then
  incr(stats_key, 'speculative_wins', 1)
end
local primary = attempt_rec('primary', t, 3)
local won  -- the backup copy's record when it won (read before clear_backup empties its fields)
if copy == 'backup' then
  won = attempt_of(task_key, 'backup')
  attempt_log(job_key, won, 'done', nil, ms)
  attempt_log(job_key, primary, 'superseded', nil, ms)
else
  attempt_log(job_key, primary, 'done', nil, ms)
  if has_backup then
    attempt_log(job_key, attempt_of(task_key, 'backup'), 'superseded', nil, ms)
  end
end
if has_backup then
  clear_backup(task_key)
end
local cost = tonumber(t[9] or 1) or 1  -- read before the result's fields are written
redis.call('HSET', task_key, 'status', 'done', 'result', result, 'finished_at', secs(ms), 'duration', duration,
  'done_token', done_token(token))
-- A finished task keeps only what its readers show: the fields every running task had go (an absent field reads
-- as empty), so that a million done tasks stay small (docs/finished-work.md). A task that had a backup copy
-- keeps clear_backup's empty fields: few do.
redis.call('HDEL', task_key, 'lease', 'error', 'promoted')
if won then  -- the result is the backup's: `results`, `status` and the dashboard name the worker that made it
  redis.call('HSET', task_key, 'worker', won.worker)
  if won.started ~= '' then
    redis.call('HSET', task_key, 'started_at', won.started)
  end
end
for i = 11, #ARGV - 1, 2 do
  redis.call('HSET', task_key, ARGV[i], ARGV[i + 1])
end
if spent ~= '' and spent_key and redis.call('SISMEMBER', spent_key, '*') == 1 then
  redis.call('SADD', spent_key, spent)  -- a trusting worker never runs this task again (signing.py)
end
redis.call('DEL', lease_key)
redis.call('ZREM', leases_key, task_id)
local still_running = move(job_key, 'running', 'done')
if score > 0 then  -- seconds per (cost / score): how the dispatcher's callers estimate a straggler's end
  incr(job_key, 'unit_sum', tonumber(duration) * score / cost, true)
  incr(job_key, 'unit_n', 1)
end
incr(stats_key, 'done', 1)
observe_duration(histogram_key, tonumber(duration))
clear_current(worker_key, task_id)
if promote and redis.call('EXISTS', staged_key) == 0 then
  artifacts = ''  -- its staging expired before it completed: no index that names missing chunks
  incr(stats_key, 'artifacts_lost', 1)
  redis.call('HSET', task_key, 'artifacts_lost', '1')  -- its result proof names an index it lacks (signing.py)
end
if artifacts ~= '' then
  redis.call('HSET', task_key, 'artifacts', artifacts)
  incr(job_key, 'artifact_bytes', artifact_bytes)
  if artifact_store ~= '' then
    redis.call('HSET', job_key, 'artifact_store', artifact_store)
  end
  if promote then
    redis.call('RENAME', staged_key, files_key)
    redis.call('PERSIST', files_key)
  end
end
emit(events_key, 'task', task_id, 'done')
ended(job_key, task_id, 'done')
if not still_running or still_running <= 0 then  -- else the job has not ended: no need to read its counters
  maybe_finish(job_key, events_key, job_of(task_id), ms)
end
return {1, 'done'}
