-- project_attach: a job (being submitted) refers to a project tree. The first job of a tree makes it hold each
-- of its files (a count per file in the refs hash, the stored copy's TTL dropped); a later one only joins.
-- A file the tree needs that the mesh no longer holds (a job that held it went meanwhile) is named in the
-- reply and nothing changes: the submitter sends it and calls again. Files stored in an object store (blob
-- prefix '') are present when a tree holds them or this caller just wrote them ('+' before the digest).
--
-- project_attach(
--   keys = {tree manifest, tree's jobs zset, refs hash, trees zset},
--   args = {job id, tree digest, manifest JSON, blob key prefix ('' for an object store), file digest...}
-- )
-- Reply: {1, 'attached', 'new', 0|1} or {0, 'missing', 'files', digests joined by ','}.

local tree_key = KEYS[1]
local jobs_key = KEYS[2]
local refs_key = KEYS[3]
local trees_key = KEYS[4]

local job_id = ARGV[1]
local tree = ARGV[2]
local manifest = ARGV[3]
local blob_prefix = ARGV[4]
local FIRST_FILE = 5

local ms = now_ms()
local new = redis.call('ZCARD', jobs_key) == 0 or redis.call('EXISTS', tree_key) == 0
if new then
  local missing, shas, seen = {}, {}, {}
  for i = FIRST_FILE, #ARGV do
    local arg = ARGV[i]
    local written = string.sub(arg, 1, 1) == '+'
    local sha = written and string.sub(arg, 2) or arg
    if not seen[sha] then
      seen[sha] = true
      shas[#shas + 1] = sha
      if not redis.call('HGET', refs_key, sha) then
        local there = written
        if blob_prefix ~= '' then
          there = redis.call('EXISTS', blob_prefix .. sha) == 1
        end
        if not there then
          missing[#missing + 1] = sha
        end
      end
    end
  end
  if #missing > 0 then
    return {0, 'missing', 'files', table.concat(missing, ',')}
  end
  for _, sha in ipairs(shas) do
    redis.call('HINCRBY', refs_key, sha, 1)
    if blob_prefix ~= '' then
      redis.call('PERSIST', blob_prefix .. sha)
    end
  end
  redis.call('SET', tree_key, manifest)
end
redis.call('ZADD', jobs_key, ms, job_id)
redis.call('ZADD', trees_key, ms, tree)
return {1, 'attached', 'new', new and 1 or 0}
