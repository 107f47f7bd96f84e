-- heartbeat: renew the worker's registration and, if it holds one, its lease; report cancellation.
-- A different or missing epoch means the broker lost its data: nothing else is touched.
--
-- heartbeat(
--   keys = {worker hash, workers zset, lease key, leases zset, task hash (unused when idle), epoch string},
--   args = {worker id, worker TTL (ms), lease token (the plain token) or '', lease TTL (ms), task id or '',
--           the epoch the worker joined}
-- )
-- Reply (see _lib.lua): {1, lease state, 'registered', 0|1, 'server_ms', server time (ms)}, the lease
-- state 'none' | 'ok' | 'lost' | 'cancelled'; or {0, 'epoch changed', 'server_ms', server time (ms)}.

local worker_key = KEYS[1]
local workers_key = KEYS[2]
local lease_key = KEYS[3]
local leases_key = KEYS[4]
local task_key = KEYS[5]
local epoch_key = KEYS[6]

local worker_id = ARGV[1]
local worker_ttl_ms = ARGV[2]
local token = ARGV[3]
local ttl_ms = tonumber(ARGV[4])
local task_id = ARGV[5]
local epoch = ARGV[6]

local ms = now_ms()
if redis.call('GET', epoch_key) ~= epoch then
  return {0, 'epoch changed', 'server_ms', ms}
end
local registered = redis.call('EXISTS', worker_key)
if registered == 1 then
  redis.call('HSET', worker_key, 'last_heartbeat', secs(ms))
  redis.call('PEXPIRE', worker_key, worker_ttl_ms)
  redis.call('ZADD', workers_key, ms, worker_id)
end
local lease = 'none'
if token ~= '' then
  local t = redis.call('HMGET', task_key, 'status', 'lease', 'backup')
  local status, primary, backup = t[1], t[2], t[3]
  token = digest(token)
  if status == 'cancelled' then
    lease = 'cancelled'
  elseif status == 'running' and primary == token then
    redis.call('SET', lease_key, token, 'PX', ttl_ms)
    redis.call('ZADD', leases_key, ms + ttl_ms, task_id)
    lease = 'ok'
  elseif status == 'running' and backup == token then
    redis.call('HSET', task_key, 'backup_until', ms + ttl_ms)  -- a backup copy's lease
    lease = 'ok'
  else
    lease = 'lost'
  end
end
return {1, lease, 'registered', registered, 'server_ms', ms}
