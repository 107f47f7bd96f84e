-- dispatch: give this worker the task it should run now, decided against the live fleet, or nothing.
-- Late binding: nothing about placement is fixed at submit. In one atomic step:
--  1. jobs: the highest priority with a queued task whose requirements this worker meets; among
--     jobs of that priority, the one with the fewest running tasks, then the least queued work (a small job
--     goes first even where every job runs nothing at the moment of asking: a worker alone), then the
--     oldest: fair share;
--  2. the task, by cost, from that job's queued tasks: a worker alone takes the lightest (its makespan
--     is the same in any order, and heavy tasks stay for stronger workers that may join); otherwise
--     the heaviest it can finish within the horizon, i.e. cost <= score * max(W / S, c_max / s_max)
--     (W the job's queued cost, S the fleet's total score), so the strongest takes the heaviest and
--     weaker workers lighter ones (a worker weaker than the strongest leaves the heaviest cost to it
--     while a lighter task is there); when even the lightest is beyond its horizon it takes the lightest
--     (no worker idles while work it may run waits; a backup copy can rescue a straggler);
--  3. lease it (as acquire.lua). Finding nothing, the worker joins the idle set, woken when work arrives.
-- The worker's tier is computed here too, from the registered scores (tier_of in _lib.lua): its delivery goes
-- through that tier's RQ queue, and as it takes a task the tier's window of waiting tasks is refreshed
-- (refresh_window). Neither changes which task it takes.
-- A task whose last attempt failed on this worker (fail.lua's 'avoid', until 'avoid_until'), or that ran
-- out of memory and waits for a live worker with more ('bigger'), is left to the other live workers meanwhile: the next task of its job instead, or another job, or nothing (this
-- worker asks again within a heartbeat interval, and takes it once the time is up).
--
-- dispatch(
--   keys = {ready zset, scores zset, fleet hash, worker hash, leases zset, events stream, idle set},
--   args = {worker id, lease TTL (ms), this worker's score,
--           the lease token to hold what it takes (made by the worker; only its digest is stored),
--           the number of tiers (GPUMESH_TIERS; 3 when absent)}
-- )
-- Reply (see _lib.lua): the lease (lease_reply) with 'fleet_version', the registered fleet's version, and
-- 'tier', the worker's tier, appended; or {0, 'idle', 'fleet_version', version} when there is nothing it may run;
-- or {0, 'prepare', 'fleet_version', version, 'env', digest, 'job', job id} when the job it should serve first
-- needs an env this worker's machine lacks (env_state): it builds the env, leasing nothing meanwhile, and asks again.
--
-- Nothing written into a job or task may make this script raise (every worker would fail its dispatch,
-- and the mesh would stall): any credential that writes jobs and tasks can write garbage there. A ready
-- entry whose job is unreadable (not a hash, requirement classes that are not JSON, a pending set that
-- is not a zset) leaves the ready index; a pending member that is not a task index leaves its pending
-- set; a queued task whose fields (or its job's) the worker could not run by is failed with the reason,
-- never leased. Other jobs go on being dispatched.

-- Made once, when the library loads (scripts.py puts what is above PER_CALL outside the function):

-- what we choose by, then what take() needs, in one read per candidate job; read by name (JOB_AT)
-- (Loading code may call only Lua itself: no unpack or ipairs here.)
local JOB_FIELDS = {'classes', 'running', 'created_at', 'pending_cost'}
for i = 1, #TAKE_JOB do
  JOB_FIELDS[#JOB_FIELDS + 1] = TAKE_JOB[i]
end
JOB_FIELDS[#JOB_FIELDS + 1] = 'submitter'  -- the credential that submitted it (lender_accepts)
JOB_FIELDS[#JOB_FIELDS + 1] = 'env'  -- its environment's lock digest, and whether its builds failed (env_state)
JOB_FIELDS[#JOB_FIELDS + 1] = 'env_dead'
JOB_FIELDS[#JOB_FIELDS + 1] = 'project'  -- its project's tree digest (placed where it is held, as an env)
local JOB_AT = at(JOB_FIELDS)
local NO_REQUIREMENTS = '[[]]'
-- Job fields the lease carries as numbers, as the worker reads them.
local NUMERIC = {{'timeout', 'number'}, {'expires_at', 'number'}, {'max_attempts', 'integer'}}
-- The job fields a lease carries as text: a missing one would cut the reply short.
local REQUIRED = {'id', 'script_sha', 'script_name'}

-- Text that Python's int() (kind 'integer') or float() ('number') reads as Lua does, or nil.
local function numeric(text, kind)
  if type(text) ~= 'string' then
    return nil
  end
  if kind == 'integer' then
    if string.find(text, '^%s*[-+]?%d+%s*$') and #text <= 15 then
      return tonumber(text)
    end
    return nil
  end
  return decimal(text)
end

-- Why a queued task (and its job) cannot be leased to a worker, or nil: the fields the lease carries.
local function malformed(task, job, index)
  for _, name in ipairs(REQUIRED) do
    if type(job[JOB_AT[name]]) ~= 'string' then
      return "its job's field '" .. name .. "' is missing"
    end
  end
  for _, f in ipairs(NUMERIC) do
    local v = job[JOB_AT[f[1]]]
    if v ~= false and v ~= nil and numeric(v, f[2]) == nil then  -- expires_at may be absent
      return "its job's field '" .. f[1] .. "' is not a number"
    end
  end
  if type(job[JOB_AT.timeout]) ~= 'string' then
    return "its job's field 'timeout' is missing"
  end
  if type(job[JOB_AT.max_attempts]) ~= 'string' then
    return "its job's field 'max_attempts' is missing"
  end
  if numeric(task[3], 'integer') ~= index then
    return "its field 'index' is not its index"
  end
  if task[2] and numeric(task[2], 'integer') == nil then
    return "its field 'attempts' is not a number"
  end
  if type(task[4]) ~= 'string' then
    return "its field 'payload' is missing"
  end
  return nil
end

-- What a task waiting for another worker is read by (avoided_by), and the pick's TAKE_TASK fields read with
-- them in one call.
local AVOID = {'avoid', 'avoid_until', 'bigger', 'bigger_than', 'bigger_on'}
local TAKE_AND_AVOID = {}
for i = 1, #TAKE_TASK do
  TAKE_AND_AVOID[i] = TAKE_TASK[i]
end
for i = 1, #AVOID do
  TAKE_AND_AVOID[#TAKE_TASK + i] = AVOID[i]
end

-- per call

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
local tiers = math.max(1, math.min(math.floor(tonumber(ARGV[5]) or 3), 100))

-- with the fleet, when each tier's window was last refreshed ('at:<k>', refresh_window)
local refreshed = {}
for k = 0, tiers - 1 do
  refreshed[k + 1] = 'at:' .. int(k)
end
local n, sum, max, version, fleet_row = fleet(scores_key, fleet_key, refreshed)

-- The worker's fields in one read: the task it holds, its resources, the envs its machine holds and failed
-- to build (env_state), and its tier as last computed here ('dispatch_tier').
local wf = redis.pcall('HMGET', worker_key, 'current_task', 'resources', 'envs', 'env_failed', 'dispatch_tier')
if type(wf) ~= 'table' or wf.err then
  wf = {}  -- not a hash
end
local held = wf[1]
-- Its tier: its rank among the registered scores (tier_of), which only a worker joining or leaving changes, and
-- then the fleet's version moves; so the tier is kept in its hash with the version and tier count it was
-- computed for ('<version>/<tiers>/<tier>'), and computed again once either differs.
local my_tier
do
  local seen = version .. '/' .. int(tiers) .. '/'
  local kept = type(wf[5]) == 'string' and string.sub(wf[5], 1, #seen) == seen and tonumber(string.sub(wf[5], #seen + 1))
  if kept and kept >= 0 and kept < tiers and kept == math.floor(kept) then
    my_tier = kept
  else
    my_tier = tier_of(scores_key, worker_id, n, tiers)
    if type(wf[2]) == 'string' then  -- a registered worker (its resources): keep it for the next call
      redis.pcall('HSET', worker_key, 'dispatch_tier', seen .. my_tier)
    end
  end
end

-- The same call again (redis-py sends a command again when the link failed before its reply came, though
-- this script may have run): the task this worker holds under this very token, made for this call, is the
-- answer again, not a second task left leased to a worker that never heard of it.
do
  if type(held) == 'string' and held ~= '' then
    local t = redis.pcall('HMGET', PREFIX .. 'task:' .. held, 'status', 'lease', 'worker', 'attempts', 'index',
      'payload', 'sig')
    if type(t) == 'table' and not t.err and t[1] == 'running' and t[2] == digest(token) and t[3] == worker_id then
      local job, J = redis.pcall('HMGET', PREFIX .. 'job:' .. (job_of(held) or ''), unpack(TAKE_JOB)), TAKE_JOB_AT
      if type(job) == 'table' and not job.err and job[J.id] then
        return lease_reply({
          task_id = held, attempt = tonumber(t[4]) or 1, job_id = job[J.id], index = t[5], payload = t[6],
          script_sha = job[J.script_sha], script_name = job[J.script_name], timeout = job[J.timeout],
          key_id = job[J.key_id], expires_at = job[J.expires_at], max_attempts = job[J.max_attempts],
          signature = t[7], server_ms = now_ms(), fleet_version = version, tier = my_tier,
        })
      end
    end
  end
end

-- Nothing it may run: the worker joins the idle set (woken when work arrives), and its registration names
-- no task any more. A worker asks only when it runs nothing, and a cancelled task's worker never completes
-- or fails it, so this is where that task leaves its `current_task` (what `workers` and the dashboard show).
local function go_idle()
  redis.call('SADD', idle_key, worker_id)
  if type(held) == 'string' and held ~= '' then  -- as read above: nothing in this call wrote it since
    redis.pcall('HSET', worker_key, 'current_task', '')  -- pcall: not a hash must not stop dispatch
  end
  return {0, 'idle', 'fleet_version', version}
end
-- A job it may run once it holds the job's env: it prepares the env (not idle), then asks again.
local function go_prepare(env, job_id)
  if type(held) == 'string' and held ~= '' then
    redis.pcall('HSET', worker_key, 'current_task', '')
  end
  return {0, 'prepare', 'fleet_version', version, 'env', env, 'job', job_id}
end
local raw = wf[2]
if type(raw) ~= 'string' then
  raw = nil  -- none, or not a hash
end
local resources  -- decoded only when some queued work has requirements, or the worker trusts keys
local trusting = raw and string.find(raw, '"trusts"', 1, true) ~= nil
-- The worker's resources, decoded, or nil when they are not a JSON object. A trusting worker whose
-- resources do not decode trusts no key (it runs nothing rather than unsigned work).
local function decode_resources()
  local ok, res = pcall(cjson.decode, raw)
  if ok and type(res) == 'table' then
    return res
  end
  if trusting then
    return {trusts = ','}
  end
  return {}
end
-- A lender's limits (--max-task-hours, --accept-from): each candidate job is checked against them.
local limited = raw and (string.find(raw, '"max_task_hours"', 1, true) or string.find(raw, '"accept_from"', 1, true))
if trusting or limited then
  resources = decode_resources()
end
-- queued -> failed without running: a task that cannot be leased (see malformed). Each write may meet
-- a key of the wrong type (an attacker's): none of them may raise.
local function refuse(t, why)
  local ms = now_ms()
  redis.pcall('HSET', t.task_key, 'status', 'failed', 'lease', '', 'error', 'malformed task: ' .. why,
    'error_kind', 'refused', 'finished_at', secs(ms))
  pcall(move, t.job_key, 'queued', 'failed')
  pcall(incr, t.job_key, 'failed:refused', 1)
  pcall(incr, PREFIX .. 'stats', 'attempts_failed:refused', 1)
  pcall(emit, events_key, 'task', t.task_id, 'failed')
  pcall(ended, t.job_key, t.task_id, 'failed')
  if redis.pcall('RPUSH', t.job_key .. ':failed', t.task_id) == 101 then
    redis.pcall('LTRIM', t.job_key .. ':failed', 0, 99)
  end
  pcall(maybe_finish, t.job_key, events_key, t.job_id, ms)
end

-- The requirement classes (JSON) say this worker may run class klass; nil when they do not decode.
local function meets_class(classes, klass)
  local ok, all = pcall(cjson.decode, classes)
  if not ok or type(all) ~= 'table' then
    return nil
  end
  local reqs = all[tonumber(klass) + 1] or {}
  if type(reqs) ~= 'table' then
    return nil
  end
  if #reqs == 0 then
    return true
  end
  resources = resources or (raw and decode_resources()) or {}
  local fine, meets = pcall(meets_all, reqs, resources)
  if not fine then
    return nil
  end
  return meets
end

-- Whether the task at pending member ``member`` of job ``job_id`` waits for another worker than this one:
-- its last attempt failed here (fail.lua's 'avoid'), or it ran out of memory and waits for a worker with
-- more of it ('bigger' above 'bigger_than') while the one fail.lua found ('bigger_on') is live; either
-- until 'avoid_until'.
-- avoided_by decides from those fields already read (AVOID's, at f[at + 1] ... f[at + 5]; f may be a
-- pcall's error or false).
local function avoided_by(f, at)
  local until_ms = type(f) == 'table' and not f.err and tonumber(f[at + 2])
  if not until_ms or until_ms <= now_ms() then  -- the clock is read only for a task with an avoid_until
    return false
  end
  local key, above, on = f[at + 3], tonumber(f[at + 4]), f[at + 5]
  if type(key) == 'string' and key ~= '' and type(on) == 'string' then
    resources = resources or (raw and decode_resources()) or {}
    local have = decimal(tostring(resources[key]))
    if have and above and have >= above * 1.2 then  -- fail.lua's MORE: this worker has more
      return false
    end
    if redis.call('EXISTS', PREFIX .. 'worker:' .. on) == 1 then
      return true  -- the worker with more is live: it is that one's
    end
  end
  return f[at + 1] == worker_id
end
local function avoided(job_id, member)
  local index = numeric(member, 'integer')
  if not index then
    return false
  end
  return avoided_by(redis.pcall('HMGET', PREFIX .. 'task:' .. job_id .. '-' .. int(index), unpack(AVOID)), 0)
end
-- The lightest of the first few pending tasks this worker need not leave to others, or nil (none: this
-- job is not for this worker now).
local function unavoided(job_id, pk)
  local some = redis.call('ZRANGE', pk, '0', '7', 'WITHSCORES')
  for i = 1, #some, 2 do
    if not avoided(job_id, some[i]) then
      return {some[i], some[i + 1]}
    end
  end
  return nil
end

local skip = {}  -- ready members left to other workers in this dispatch (see avoided)
-- The first job (by the order below) whose env this worker must prepare before it takes its tasks: prepared
-- unless a job of at least its priority runs here now (what it holds goes first).
local prepare, prepare_prio
for _ = 1, 8 do  -- more than once only when a pending entry turns out stale, or a task is left to others
  local entries = redis.call('ZREVRANGE', ready_key, '0', '-1', 'WITHSCORES')
  local best, best_prio, best_running, best_left, best_created, best_job, best_class, best_fields
  for i = 1, #entries, 2 do
    local member, prio = entries[i], tonumber(entries[i + 1])
    if best and prio < best_prio then
      break
    end
    if not skip[member] then  -- left to other workers in this dispatch (see avoided)
      local job_id, klass = string.match(member, '^(.*)/(%d+)$')
      if klass and #klass > 6 then
        job_id = nil  -- no job has a million requirement classes
      end
      local job = job_id and redis.pcall('HMGET', PREFIX .. 'job:' .. job_id, unpack(JOB_FIELDS))
      local classes = type(job) == 'table' and not job.err and job[JOB_AT.classes]  -- JSON: per class, its requirements
      local ok = true
      if type(classes) == 'string' and classes ~= NO_REQUIREMENTS then
        ok = meets_class(classes, klass)
      end
      if type(classes) ~= 'string' or ok == nil or redis.call('TYPE', pending_key(job_id, klass)).ok ~= 'zset' then
        redis.call('ZREM', ready_key, member)  -- drained, cancelled or deleted (or not a job at all)
      else
        if ok and trusting then
          ok = accepts_signer(resources, job[JOB_AT.key_id])  -- an unsigned or foreign-signed job is for other workers
        end
        if ok and limited then  -- a task longer than the lender allows, or a submitter it does not accept
          ok = lender_accepts(resources, job[JOB_AT.timeout], job[JOB_AT.submitter])
        end
        if ok then
          local env = env_state(wf[3], wf[4], job[JOB_AT.env], job[JOB_AT.env_dead])
          if env == 'prepare' and not prepare then
            prepare, prepare_prio = {job[JOB_AT.env], job_id}, prio
          end
          ok = env == 'run'
        end
        if ok then
          local running = tonumber(job[JOB_AT.running]) or 0
          local left, created = tonumber(job[JOB_AT.pending_cost]) or 0, tonumber(job[JOB_AT.created_at]) or 0
          if not best or running < best_running or (running == best_running and (left < best_left or
              (left == best_left and created < best_created))) then
            best, best_prio, best_running, best_left, best_created = member, prio, running, left, created
            best_job, best_class, best_fields = job_id, klass, job
          end
        end
      end
    end
  end
  if prepare and (not best or prepare_prio > best_prio) then
    return go_prepare(prepare[1], prepare[2])
  end
  if not best then
    return go_idle()
  end

  local job_key = PREFIX .. 'job:' .. best_job
  local pk = pending_key(best_job, best_class)
  local pick, heaviest, limit
  if n > 1 then
    -- The heaviest task waits for the strongest worker holding the job's env, not one that would build it first;
    -- for a job without an env, its project's tree (made in the lease, but not for nothing where it is large).
    local env, project = best_fields[JOB_AT.env], best_fields[JOB_AT.project]
    if type(env) == 'string' and env ~= '' then
      max = env_strongest(env, max)
    elseif type(project) == 'string' and project ~= '' then
      max = env_strongest(project, max)
    end
    heaviest = redis.call('ZREVRANGE', pk, '0', '0', 'WITHSCORES')
    local queued_cost = tonumber(best_fields[JOB_AT.pending_cost] or 0) or 0
    local horizon = math.max(queued_cost / math.max(sum, 1e-9), tonumber(heaviest[2]) / math.max(max, 1e-9))
    limit = score * horizon * (1 + 1e-9)
    pick = redis.call('ZREVRANGEBYSCORE', pk, limit, '-inf', 'WITHSCORES', 'LIMIT', '0', '1')
    if pick[1] and score < max and tonumber(pick[2]) >= tonumber(heaviest[2]) then
      -- the heaviest cost is the strongest worker's, while a lighter task is there for this one
      local lighter = redis.call('ZREVRANGEBYSCORE', pk, '(' .. heaviest[2], '-inf', 'WITHSCORES', 'LIMIT', '0', '1')
      if lighter[1] then
        pick = lighter
      end
    end
  end
  if not pick or not pick[1] then
    pick = redis.call('ZRANGE', pk, '0', '0', 'WITHSCORES')
  end
  local task  -- the pick's TAKE_TASK fields, read with its AVOID fields (only a fleet of more than one avoids)
  if pick[1] and n > 1 then
    local index = numeric(pick[1], 'integer')
    local f = index and index >= 0 and redis.pcall('HMGET', PREFIX .. 'task:' .. best_job .. '-' .. int(index),
      unpack(TAKE_AND_AVOID))
    if avoided_by(f, #TAKE_TASK) then
      pick = unavoided(best_job, pk)  -- it waits for another worker: the next few it need not leave
    else
      task = f or nil
    end
  end
  if not pick then
    skip[best] = true  -- its tasks wait for another worker: look at the other jobs
  else
    local index, cost = numeric(pick[1], 'integer'), tonumber(pick[2])
    if not index or index < 0 then  -- not a task's index: out of the pending set, and look again
      redis.call('ZREM', pk, pick[1])
      index = -1
    end
    local task_id = best_job .. '-' .. int(index)
    local task_key = PREFIX .. 'task:' .. task_id
    if index < 0 then
      task = {}
    elseif not task then
      task = redis.pcall('HMGET', task_key, unpack(TAKE_TASK))
    end
    if task.err then
      task = {}  -- not a hash: not a task
    end
    -- two members seen (the heaviest and another, which unpend removes as pad(index)): the pending set
    -- stays after this one leaves it
    local remains = heaviest ~= nil and heaviest[1] ~= nil and heaviest[1] ~= pick[1] and index >= 0 and
      heaviest[1] ~= pad(index)
    local taken = {task_key = task_key, job_key = job_key, ready_key = ready_key, job_id = best_job, index = index,
      cost = cost, klass = best_class, tier = task[TAKE_TASK_AT.tier], remains = remains}
    local why = task[1] == 'queued' and malformed(task, best_fields, index)
    if why then
      unpend(taken)
      redis.call('ZREM', pk, pick[1])
      refuse({task_key = task_key, job_key = job_key, task_id = task_id, job_id = best_job}, why)
    elseif task[1] == 'queued' then  -- its status
      unpend(taken)
      redis.call('SREM', idle_key, worker_id)
      local ms = now_ms()
      if window_due(fleet_row[6 + my_tier], ms) then  -- checked first: most calls find it refreshed a moment ago
        refresh_window({tier = my_tier, at = fleet_row[6 + my_tier], fleet_key = fleet_key, job_id = best_job,
          job_key = job_key, pk = pk, limit = limit, ms = ms, below = score < max and heaviest and heaviest[2] or nil})
      end
      return take({
        task_key = task_key, lease_key = PREFIX .. 'lease:' .. task_id, leases_key = leases_key, job_key = job_key,
        events_key = events_key, worker_key = worker_key, task_id = task_id, worker_id = worker_id, ttl_ms = ttl_ms,
        ms = ms, task = task, job = best_fields, job_at = JOB_AT, worker_known = raw ~= nil,
        fleet_version = version, token = token, tier = my_tier,
      })
    end
    if not why then
      -- not queued any more: a stale entry, drop it (and its cost from the horizon) and look again
      if index >= 0 then
        unpend(taken)
      end
      redis.call('ZREM', pk, pick[1])  -- the member as it is (unpend removes it padded)
    end
  end
end
return go_idle()
