-- stage: write a chunk of a job's tasks in one call (submit): each task's hash, its place in the job's
-- task list and its member in the job's pending zset of its requirement class. Not visible to
-- dispatch until the job enters the ready index (submit's last step). One call per chunk instead of
-- one command per task keeps a 1,000,000-task submit within seconds. The chunk's tasks have consecutive
-- indexes and travel as three arguments, not five a task: packing those cost the client more than
-- Redis spent on the call. A payload is JSON text with only printable ASCII (the client escapes the
-- rest), so a newline separates two.
--
-- stage(
--   keys = {job task list},
--   args = {job id, the chunk's first index, its payloads (JSON) joined by newlines,
--           their costs joined by newlines ('' when every cost is 1),
--           their requirement classes joined by newlines ('' when every class is 0)}
-- )
-- Reply (see _lib.lua): {1, 'staged', 'tasks', the number of tasks written}.

local tasks_key = KEYS[1]

local job_id = ARGV[1]
local first = tonumber(ARGV[2])

local function lines(text)
  local out = {}
  for line in string.gmatch(text, '[^\n]+') do
    out[#out + 1] = line
  end
  return out
end
local payloads = lines(ARGV[3])
local costs = ARGV[4] ~= '' and lines(ARGV[4]) or nil
local classes = ARGV[5] ~= '' and lines(ARGV[5]) or nil
if (costs and #costs ~= #payloads) or (classes and #classes ~= #payloads) then
  return redis.error_reply('stage: ' .. #payloads .. ' payloads but ' .. (costs and #costs or #payloads) ..
    ' costs and ' .. (classes and #classes or #payloads) .. ' classes (a payload with a newline?)')
end

local task_prefix = PREFIX .. 'task:' .. job_id .. '-'
local ids = {}
local by_class = {}
for k = 1, #payloads do
  local n = first + k - 1
  local index = string.format('%d', n)
  local cost = costs and costs[k] or '1'
  local klass = classes and classes[k] or '0'
  -- one HSET a task: a default cost or class is not written (dispatch reads them as 1 and 0)
  if tonumber(cost) == 1 and klass == '0' then
    redis.call('HSET', task_prefix .. index, 'index', index, 'payload', payloads[k], 'status', 'queued')
  elseif klass == '0' then
    redis.call('HSET', task_prefix .. index, 'index', index, 'payload', payloads[k], 'status', 'queued', 'cost', cost)
  else
    local fields = {'index', index, 'payload', payloads[k], 'status', 'queued', 'class', klass}
    if tonumber(cost) ~= 1 then
      fields[#fields + 1] = 'cost'
      fields[#fields + 1] = cost
    end
    redis.call('HSET', task_prefix .. index, unpack(fields))
  end
  ids[k] = job_id .. '-' .. index
  local members = by_class[klass]
  if not members then
    members = {}
    by_class[klass] = members
  end
  members[#members + 1] = cost
  members[#members + 1] = pad(n)
end
for i = 1, #ids, 1000 do
  redis.call('RPUSH', tasks_key, unpack(ids, i, math.min(i + 999, #ids)))
end
for klass, members in pairs(by_class) do
  for i = 1, #members, 2000 do
    redis.call('ZADD', pending_key(job_id, klass), unpack(members, i, math.min(i + 1999, #members)))
  end
end
return {1, 'staged', 'tasks', #payloads}
