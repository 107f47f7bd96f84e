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
-- KEYS[1] ready zset    KEYS[2] scores zset   KEYS[3] fleet hash    KEYS[4] worker hash
-- KEYS[5] leases zset   KEYS[6] events stream KEYS[7] idle set
-- ARGV[1] worker id     ARGV[2] lease TTL (ms)   ARGV[3] this worker's score
-- Returns take()'s lease reply (see _lib.lua) followed by the fleet version,
--      or {0, 'idle', fleet version}.
local me, ttl, score = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local n, sum, max, version = fleet(KEYS[2], KEYS[3])
local raw = redis.call('HGET', KEYS[4], 'resources')
local resources  -- decoded only when some queued work has requirements
-- what we choose by, then what take() needs, in one read per candidate job
local JOB_FIELDS = {'classes', 'running', 'created_at', 'pending_cost', unpack(TAKE_JOB)}
local NO_REQUIREMENTS = '[[]]'

for _ = 1, 8 do  -- more than once only when a pending entry turns out stale (a task no longer queued)
  local entries = redis.call('ZREVRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  local best, best_prio, best_running, best_created, best_job, best_class, best_fields
  for i = 1, #entries, 2 do
    local member, prio = entries[i], tonumber(entries[i + 1])
    if best and prio < best_prio then
      break
    end
    local job_id, klass = string.match(member, '^(.*)/(%d+)$')
    local job = job_id and redis.call('HMGET', PREFIX .. 'job:' .. job_id, unpack(JOB_FIELDS))
    if not job or not job[1] or redis.call('EXISTS', pending_key(job_id, klass)) == 0 then
      redis.call('ZREM', KEYS[1], member)  -- drained, cancelled or deleted
    else
      local ok = true
      if job[1] ~= NO_REQUIREMENTS then
        local reqs = cjson.decode(job[1])[tonumber(klass) + 1] or {}
        if #reqs > 0 then
          resources = resources or (raw and cjson.decode(raw)) or {}
          ok = meets_all(reqs, resources)
        end
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
    redis.call('SADD', KEYS[7], me)
    return {0, 'idle', version}
  end

  local job_key = PREFIX .. 'job:' .. best_job
  local pk = pending_key(best_job, best_class)
  local pick
  if n > 1 then
    local heaviest = redis.call('ZREVRANGE', pk, 0, 0, 'WITHSCORES')
    local queued_cost = tonumber(best_fields[4] or 0) or 0
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
  local t = redis.call('HMGET', task_key, unpack(TAKE_TASK))
  if t[1] == 'queued' then
    unpend(task_key, job_key, KEYS[1], best_job, index, cost, best_class)
    redis.call('SREM', KEYS[7], me)
    local job = {}
    for k = 1, #TAKE_JOB do
      job[k] = best_fields[4 + k]
    end
    local lease = take(task_key, PREFIX .. 'lease:' .. task_id, KEYS[5], job_key, KEYS[6], KEYS[4], task_id, me, ttl,
      now_ms(), t, job, raw ~= nil)
    lease[#lease + 1] = version
    return lease
  end
  -- not queued any more: a stale entry, drop it (and its cost from the horizon) and look again
  unpend(task_key, job_key, KEYS[1], best_job, index, cost, best_class)
end
redis.call('SADD', KEYS[7], me)
return {0, 'idle', version}
