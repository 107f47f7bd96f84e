-- speculate: start a backup copy of a running task on a stronger worker (a straggler's twin).
-- Allowed when the task's job allows it (the default; submit --no-speculate turns it off), the task has
-- no live backup, this worker is at least `speedup` times as strong as the primary's, and either
--   mode 'idle': the job has nothing left queued (the end of a job, this worker found nothing else), or
--   mode 'straggler': the caller found the primary would end long after the rest of the work (a much
--   stronger worker joined after a weak one took a heavy task); the job may still have queued tasks.
-- The first fenced completion of either copy wins (complete.lua); the other learns 'lost' at its
-- next heartbeat and is killed. A backup does not spend an attempt.
--
-- speculate(
--   keys = {task hash, job hash, worker hash, scores zset, stats hash},
--   args = {task id, worker id, lease TTL (ms), this worker's score,
--           minimum speed-up over the primary's worker, mode 'idle' or 'straggler',
--           the backup's lease token (made by the worker; only its digest is stored)}
-- )
-- Reply (see _lib.lua): the backup's lease (lease_reply) with 'backup', 1 and 'backup_mode', mode
-- appended; or {0, why}.

local task_key = KEYS[1]
local job_key = KEYS[2]
local worker_key = KEYS[3]
local scores_key = KEYS[4]
local stats_key = KEYS[5]

local task_id = ARGV[1]
local worker_id = ARGV[2]
local ttl_ms = tonumber(ARGV[3])
local score = tonumber(ARGV[4])
local speedup = tonumber(ARGV[5])
local mode = ARGV[6]
local token = ARGV[7]

local t = redis.call('HMGET', task_key, 'status', 'worker', 'backup', 'backup_until', 'attempts', 'index',
  'payload', 'sig', 'class', 'backup_worker', 'lease', 'promoted')
local status, primary_worker, backup, backup_until, attempts = t[1], t[2], t[3], t[4], t[5]
local index, payload, signature, klass, backup_worker = t[6], t[7], t[8], t[9], t[10]
if status ~= 'running' then
  return {0, status or 'missing'}
end
-- The same call again (redis-py sends a command again when the link failed before its reply came, though
-- this script may have run): the backup this very call started (its token, this worker) is the answer again,
-- not 'has a backup' while a copy that never runs holds the task's backup for a lease; nor 'own task' when
-- the primary failed or lapsed in between and the backup was promoted (its token is the task's lease now).
local mine = digest(token)
local resent = (backup_worker == worker_id and backup == mine) or
  (primary_worker == worker_id and t[11] == mine and t[12] == '1')
if primary_worker == worker_id and not resent then
  return {0, 'own task'}
end
local ms = now_ms()
if not resent and backup and backup ~= '' and tonumber(backup_until or 0) > ms then
  return {0, 'has a backup'}
end
local JOB = {'speculate', 'queued', 'id', 'script_sha', 'script_name', 'timeout', 'key_id', 'expires_at',
  'max_attempts', 'classes'}
local job, J = redis.call('HMGET', job_key, unpack(JOB)), at(JOB)
local speculative, queued, job_id = job[J.speculate], job[J.queued], job[J.id]
local script_sha, script_name, timeout = job[J.script_sha], job[J.script_name], job[J.timeout]
local key_id, expires_at, max_attempts, classes = job[J.key_id], job[J.expires_at], job[J.max_attempts], job[J.classes]
local function reply()
  return lease_reply({
    task_id = task_id, attempt = tonumber(attempts), job_id = job_id, index = index,
    payload = payload, script_sha = script_sha, script_name = script_name, timeout = timeout,
    max_attempts = max_attempts, signature = signature, key_id = key_id, expires_at = expires_at,
    server_ms = ms, backup = true, backup_mode = mode,
  })
end
if resent and job_id then
  return reply()  -- started already, by this call: nothing is written twice
end
if speculative ~= '1' then
  return {0, 'not speculative'}
end
local raw = redis.call('HGET', worker_key, 'resources')
local res = raw and cjson.decode(raw) or {}
local reqs = cjson.decode(classes or '[[]]')[tonumber(klass or 0) + 1] or {}
if not meets_all(reqs, res) then
  return {0, 'requirements not met'}
end
if not accepts_signer(res, key_id) then
  return {0, 'not signed by a key it trusts'}
end
if not lender_accepts(res, timeout, redis.call('HGET', job_key, 'submitter')) then
  return {0, 'not a job its lender accepts'}
end
if mode ~= 'straggler' and tonumber(queued) > 0 then
  return {0, 'job has queued tasks'}
end
local primary = tonumber(redis.call('ZSCORE', scores_key, primary_worker) or 0)
if primary > 0 and score < primary * speedup then
  return {0, 'not faster'}
end
attempt_log(job_key, attempt_of(task_key, 'backup'), 'lost', 'lost', ms)  -- a lapsed backup, replaced here
redis.call('HSET', task_key, 'backup', digest(token), 'backup_worker', worker_id, 'backup_until', ms + ttl_ms,
  'backup_mode', mode, 'backup_started_at', secs(ms))
incr(stats_key, 'speculated', 1)
if redis.call('EXISTS', worker_key) == 1 then
  redis.call('HSET', worker_key, 'current_task', task_id)
end
return reply()
