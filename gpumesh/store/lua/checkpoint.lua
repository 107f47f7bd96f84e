-- checkpoint: make an attempt's uploaded checkpoint the task's newest, fenced like a result.
--
-- checkpoint(
--   keys = {task hash, the upload (a hash of chunks with a TTL; in an object store: not a key, the index says
--           where), the task's checkpoint (the newest one kept, as chunks)},
--   args = {task id, lease token, this attempt's save number (rising), its index (JSON: store, bytes, sha256,
--           chunks, and for an object store its path)}
-- )
-- Only the primary copy that holds the lease saves (a backup copy's checkpoints are not kept: it restores the
-- primary's newest, and never one the primary has half uploaded, since an upload becomes the checkpoint here,
-- whole, in one step). A save older than the one kept (an earlier attempt's, or an earlier save of this one)
-- changes nothing. Reply: {1, 'saved', 'attempt', n, 'seq', s}; or {0, why} and the upload is dropped.

local task_key = KEYS[1]
local upload_key = KEYS[2]
local kept_key = KEYS[3]

local task_id = ARGV[1]
local token = ARGV[2]
local seq = tonumber(ARGV[3])
local index = ARGV[4]

local function refuse(why)
  if upload_key ~= '' then
    redis.call('DEL', upload_key)
  end
  return {0, why}
end

local copy, refused, _, t = holder(task_key, token, {'attempts', 'ckpt_lease', 'ckpt_seq'})
if not copy then
  return refuse(refused[2])
end
if copy ~= 'primary' then
  return refuse('backup')
end
-- The caller holds the lease now, so what is kept came from an earlier lease (older: replaced) or from this
-- one, whose saves must rise.
local attempt, lease = tonumber(t[4]) or 0, digest(token)
if not seq or (t[5] == lease and seq <= (tonumber(t[6]) or 0)) then
  return refuse('older')
end
if upload_key ~= '' then
  if redis.call('EXISTS', upload_key) == 0 then
    return {0, 'missing'}  -- its TTL ran out before the save was made the task's
  end
  redis.call('RENAME', upload_key, kept_key)
  redis.call('PERSIST', kept_key)
else
  redis.call('DEL', kept_key)  -- an object store holds it: the index alone says where
end
redis.call('HSET', task_key, 'ckpt_attempt', attempt, 'ckpt_lease', lease, 'ckpt_seq', seq, 'ckpt', index,
  'ckpt_at', secs(now_ms()))
return {1, 'saved', 'attempt', attempt, 'seq', seq}
