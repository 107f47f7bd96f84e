-- env_held: a worker names the envs its machine holds ready and those it could not build (lock digests cut to
-- ENV_SHORT characters, comma-separated), as dispatch reads them (env_state), into its live registration; and
-- joins the holders (a zset by score: env_strongest) of each held env and of each project tree its machine
-- holds, which dispatch reads to leave a job's heaviest task to the strongest worker that holds its env (or,
-- for a job without one, its project) rather than to one that would make it first.
--
-- env_held(
--   keys = {worker hash},
--   args = {worker id, held (csv), failed (csv), registration TTL (ms), project trees held (csv, cut alike)}
-- )
-- Reply: {1, 'held'}, or {0, 'unregistered'} when the registration is gone (written whole again at the next
-- heartbeat, and this with it).

local worker_key = KEYS[1]
local worker_id, held, failed, ttl_ms = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]) or 0
local trees = ARGV[5] or ''

local score = redis.pcall('HGET', worker_key, 'score')
if type(score) ~= 'string' then
  return {0, 'unregistered'}
end
redis.call('HSET', worker_key, 'envs', held, 'env_failed', failed)
if ttl_ms > 0 then
  redis.call('PEXPIRE', worker_key, ttl_ms)
end
-- A holders zset goes a day after its last holder named it (workers name theirs again every hour): an env or
-- tree no worker holds any more leaves nothing behind. Holders gone meanwhile are dropped as dispatch reads them.
local HOLDERS_TTL_MS = '86400000'
for _, list in ipairs({held, trees}) do
  for short in string.gmatch(list, '[^,]+') do
    local key = env_holders(short)
    -- pcall: a score that is not a number, or a key that is not a zset, adds nothing (and then sets no TTL)
    if type(redis.pcall('ZADD', key, score, worker_id)) == 'number' then
      redis.pcall('PEXPIRE', key, HOLDERS_TTL_MS)
    end
  end
end
return {1, 'held'}
