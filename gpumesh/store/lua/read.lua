-- read: the hashes of a page of tasks in one call, for readers of a job (results, as_completed, the dashboard):
-- a job of a million tasks is read a page per call, not a call per task. Read-only (registered 'no-writes').
--
-- read(
--   keys = {task hash, task hash, ...},
--   args = {}
-- )
-- Reply (see _lib.lua): {1, 'read', 'hashes', {the HGETALL of each key, in the order of KEYS; empty for one
-- that is gone}}.

local hashes = {}
for i, key in ipairs(KEYS) do
  hashes[i] = redis.call('HGETALL', key)
end
return {1, 'read', 'hashes', hashes}
