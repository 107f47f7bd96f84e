-- project_detach: a job no longer refers to its project tree (deleted, cancelled, or its submit never
-- finished). With the tree's last job the tree goes, and each file no other tree holds: from the broker
-- here, from an object store by the caller (the reply names them).
--
-- project_detach(
--   keys = {tree manifest, tree's jobs zset, refs hash, trees zset},
--   args = {job id, tree digest, blob key prefix ('' for an object store)}
-- )
-- Reply: {1, 'kept'} (other jobs refer to it), {1, 'dropped', 'files', digests no tree holds now, joined by
-- ','} or {0, 'not attached'}.

local tree_key = KEYS[1]
local jobs_key = KEYS[2]
local refs_key = KEYS[3]
local trees_key = KEYS[4]

local job_id = ARGV[1]
local tree = ARGV[2]
local blob_prefix = ARGV[3]

if redis.call('ZREM', jobs_key, job_id) == 0 then
  return {0, 'not attached'}
end
if redis.call('ZCARD', jobs_key) > 0 then
  return {1, 'kept'}
end
local manifest = redis.call('GET', tree_key)
redis.call('DEL', tree_key)
redis.call('ZREM', trees_key, tree)
local gone, seen = {}, {}
if manifest then
  local ok, doc = pcall(cjson.decode, manifest)
  if ok and type(doc) == 'table' and type(doc.files) == 'table' then
    for _, entry in ipairs(doc.files) do
      local sha = type(entry) == 'table' and entry[2]
      if type(sha) == 'string' and not seen[sha] then
        seen[sha] = true
        local left = redis.call('HINCRBY', refs_key, sha, -1)
        if left <= 0 then
          redis.call('HDEL', refs_key, sha)
          if blob_prefix ~= '' then
            redis.call('DEL', blob_prefix .. sha)
          end
          gone[#gone + 1] = sha
        end
      end
    end
  end
end
return {1, 'dropped', 'files', table.concat(gone, ',')}
