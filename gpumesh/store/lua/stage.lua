-- stage: write a chunk of a job's tasks in one call (submit): each task's hash, its place in the job's
-- task list and its member in the job's pending zset of its requirement class. Not visible to
-- dispatch until the job enters the ready index (submit's last step). One call per chunk instead of
-- one command per task keeps a 1,000,000-task submit within seconds.
-- KEYS[1] job task list    KEYS[2..n+1] the chunk's task hashes, in order
-- ARGV[1] job id           then for each task: ARGV[2+4k] index, payload (JSON), cost, class
-- Returns the number of tasks written.
local job_id = ARGV[1]
local n = #KEYS - 1
local ids = {}
local by_class = {}
for k = 0, n - 1 do
  local index, payload, cost, klass = ARGV[2 + 4 * k], ARGV[3 + 4 * k], ARGV[4 + 4 * k], ARGV[5 + 4 * k]
  local key = KEYS[2 + k]
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
  redis.call('RPUSH', KEYS[1], unpack(ids, i, math.min(i + 999, #ids)))
end
for klass, members in pairs(by_class) do
  for i = 1, #members, 2000 do
    redis.call('ZADD', pending_key(job_id, klass), unpack(members, i, math.min(i + 1999, #members)))
  end
end
return n
