-- stage: write a chunk of a job's tasks in one call (submit): each task's hash, its place in the job's
-- task list and its member in the job's pending zset of its requirement class. Not visible to
-- dispatch until the job enters the ready index (submit's last step). One call per chunk instead of
-- one command per task keeps a 1,000,000-task submit within seconds.
--
-- stage(
--   keys = {job task list, then the chunk's task hashes in order},
--   args = {job id, then for each task of the chunk: index, payload (JSON), cost, class}
-- )
-- Reply (see _lib.lua): {1, 'staged', 'tasks', the number of tasks written}.

local tasks_key = KEYS[1]
local n_tasks = #KEYS - 1

local job_id = ARGV[1]

-- the chunk's k-th task (k = 1 .. n_tasks): its hash, and index, payload (JSON), cost, class
local function task_key(k)
  return KEYS[1 + k]
end
local function task_args(k)
  local at = 4 * k - 2
  return ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
end

local ids = {}
local by_class = {}
for k = 1, n_tasks do
  local index, payload, cost, klass = task_args(k)
  local key = task_key(k)
  redis.call('HSET', key, 'index', index, 'payload', payload, 'status', 'queued')
  if cost ~= '1' then
    redis.call('HSET', key, 'cost', cost)
  end
  if klass ~= '0' then
    redis.call('HSET', key, 'class', klass)
  end
  ids[#ids + 1] = job_id .. '-' .. index
  local members = by_class[klass]
  if not members then
    members = {}
    by_class[klass] = members
  end
  members[#members + 1] = cost
  members[#members + 1] = pad(index)
end
for i = 1, #ids, 1000 do
  redis.call('RPUSH', tasks_key, unpack(ids, i, math.min(i + 999, #ids)))
end
for klass, members in pairs(by_class) do
  for i = 1, #members, 2000 do
    redis.call('ZADD', pending_key(job_id, klass), unpack(members, i, math.min(i + 1999, #members)))
  end
end
return {1, 'staged', 'tasks', n_tasks}
