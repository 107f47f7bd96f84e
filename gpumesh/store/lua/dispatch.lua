-- dispatch: give this worker the task it should run now, decided against the live fleet, or nothing.
-- Late binding: nothing about placement is fixed at submit. In one atomic step:
--  1. jobs: the highest priority with a queued task whose requirements this worker meets; among
--     jobs of that priority, the one with the fewest running tasks (then the oldest): fair share;
--  2. the task, by cost, from that job's queued tasks: a worker alone takes the lightest (its makespan
--     is the same in any order, and heavy tasks stay for stronger workers that may join); otherwise
--     the heaviest it can finish within the horizon, i.e. cost <= score * max(W / S, c_max / s_max)
--     (W the job's queued cost, S the fleet's total score), so the strongest takes the heaviest and
--     weaker workers lighter ones (a worker weaker than the strongest leaves the heaviest cost to it
--     while a lighter task is there); when even the lightest is beyond its horizon it takes the lightest
--     (no worker idles while work it may run waits; a backup copy can rescue a straggler);
--  3. lease it (as acquire.lua). Finding nothing, the worker joins the idle set, woken when work arrives.
--
-- dispatch(
--   keys = {ready zset, scores zset, fleet hash, worker hash, leases zset, events stream, idle set},
--   args = {worker id, lease TTL (ms), this worker's score,
--           the lease token to hold what it takes (made by the worker; only its digest is stored)}
-- )
-- Reply (see _lib.lua): the lease (lease_reply) with 'fleet_version', the registered fleet's version,
-- appended; or {0, 'idle', 'fleet_version', version} when there is nothing it may run.

local ready_key = KEYS[1]
local scores_key = KEYS[2]
local fleet_key = KEYS[3]
local worker_key = KEYS[4]
local leases_key = KEYS[5]
local events_key = KEYS[6]
local idle_key = KEYS[7]

local worker_id = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local score = tonumber(ARGV[3])
local token = ARGV[4]

local n, sum, max, version = fleet(scores_key, fleet_key)
local raw = redis.call('HGET', worker_key, 'resources')
local resources  -- decoded only when some queued work has requirements, or the worker trusts keys
local trusting = raw and string.find(raw, '"trusts"', 1, true) ~= nil
if trusting then
  resources = cjson.decode(raw)
end
local KEY_ID = 4 + 6  -- where the job's key_id sits in JOB_FIELDS (CHOOSE_BY fields, then TAKE_JOB's)
-- what we choose by (the first CHOOSE_BY fields), then what take() needs, in one read per candidate job
local JOB_FIELDS = {'classes', 'running', 'created_at', 'pending_cost', unpack(TAKE_JOB)}
local CHOOSE_BY = 4
local NO_REQUIREMENTS = '[[]]'

for _ = 1, 8 do  -- more than once only when a pending entry turns out stale (a task no longer queued)
  local entries = redis.call('ZREVRANGE', ready_key, 0, -1, 'WITHSCORES')
  local best, best_prio, best_running, best_created, best_job, best_class, best_fields
  for i = 1, #entries, 2 do
    local member, prio = entries[i], tonumber(entries[i + 1])
    if best and prio < best_prio then
      break
    end
    local job_id, klass = string.match(member, '^(.*)/(%d+)$')
    local job = job_id and redis.call('HMGET', PREFIX .. 'job:' .. job_id, unpack(JOB_FIELDS))
    local classes = job and job[1]  -- JSON: per requirement class, its requirements
    if not classes or redis.call('EXISTS', pending_key(job_id, klass)) == 0 then
      redis.call('ZREM', ready_key, member)  -- drained, cancelled or deleted
    else
      local ok = true
      if classes ~= NO_REQUIREMENTS then
        local reqs = cjson.decode(classes)[tonumber(klass) + 1] or {}
        if #reqs > 0 then
          resources = resources or (raw and cjson.decode(raw)) or {}
          ok = meets_all(reqs, resources)
        end
      end
      if ok and trusting then
        ok = accepts_signer(resources, job[KEY_ID])  -- an unsigned or foreign-signed job is for other workers
      end
      if ok then
        local running, created = tonumber(job[2]) or 0, tonumber(job[3]) or 0
        if not best or running < best_running or (running == best_running and created < best_created) then
          best, best_prio, best_running, best_created = member, prio, running, created
          best_job, best_class, best_fields = job_id, klass, job
        end
      end
    end
  end
  if not best then
    redis.call('SADD', idle_key, worker_id)
    return {0, 'idle', 'fleet_version', version}
  end

  local job_key = PREFIX .. 'job:' .. best_job
  local pk = pending_key(best_job, best_class)
  local pick
  if n > 1 then
    local heaviest = redis.call('ZREVRANGE', pk, 0, 0, 'WITHSCORES')
    local queued_cost = tonumber(best_fields[4] or 0) or 0  -- pending_cost
    local horizon = math.max(queued_cost / math.max(sum, 1e-9), tonumber(heaviest[2]) / math.max(max, 1e-9))
    local limit = score * horizon * (1 + 1e-9)
    pick = redis.call('ZREVRANGEBYSCORE', pk, limit, '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if pick[1] and score < max and tonumber(pick[2]) >= tonumber(heaviest[2]) then
      -- the heaviest cost is the strongest worker's, while a lighter task is there for this one
      local lighter = redis.call('ZREVRANGEBYSCORE', pk, '(' .. heaviest[2], '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
      if lighter[1] then
        pick = lighter
      end
    end
  end
  if not pick or not pick[1] then
    pick = redis.call('ZRANGE', pk, 0, 0, 'WITHSCORES')
  end
  local index, cost = tonumber(pick[1]), tonumber(pick[2])
  local task_id = best_job .. '-' .. index
  local task_key = PREFIX .. 'task:' .. task_id
  local task = redis.call('HMGET', task_key, unpack(TAKE_TASK))
  local taken = {task_key = task_key, job_key = job_key, ready_key = ready_key, job_id = best_job, index = index,
    cost = cost, klass = best_class}
  if task[1] == 'queued' then  -- its status
    unpend(taken)
    redis.call('SREM', idle_key, worker_id)
    return take({
      task_key = task_key, lease_key = PREFIX .. 'lease:' .. task_id, leases_key = leases_key, job_key = job_key,
      events_key = events_key, worker_key = worker_key, task_id = task_id, worker_id = worker_id, ttl_ms = ttl_ms,
      ms = now_ms(), task = task, job = best_fields, job_from = CHOOSE_BY, worker_known = raw ~= nil,
      fleet_version = version, token = token,
    })
  end
  -- not queued any more: a stale entry, drop it (and its cost from the horizon) and look again
  unpend(taken)
end
redis.call('SADD', idle_key, worker_id)
return {0, 'idle', 'fleet_version', version}
