-- heartbeat: renew the worker's registration and, if it holds one, its lease; report cancellation.
-- KEYS[1] worker hash   KEYS[2] workers zset  KEYS[3] lease key     KEYS[4] leases zset
-- KEYS[5] task hash (unused when idle)                KEYS[6] epoch string
-- ARGV[1] worker id     ARGV[2] worker TTL (ms)  ARGV[3] lease token or ''  ARGV[4] lease TTL (ms)
-- ARGV[5] task id or '' ARGV[6] the epoch the worker joined
-- Returns {registered 0|1, lease state 'none'|'ok'|'lost'|'cancelled', server time ms, epoch matches 0|1}
-- A different or missing epoch means the broker lost its data: nothing else is touched.
local ms = now_ms()
if redis.call('GET', KEYS[6]) ~= ARGV[6] then
  return {0, 'none', ms, 0}
end
local registered = redis.call('EXISTS', KEYS[1])
if registered == 1 then
  redis.call('HSET', KEYS[1], 'last_heartbeat', secs(ms))
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('ZADD', KEYS[2], ms, ARGV[1])
end
local lease = 'none'
if ARGV[3] ~= '' then
  local t = redis.call('HMGET', KEYS[5], 'status', 'lease', 'backup')
  if t[1] == 'cancelled' then
    lease = 'cancelled'
  elseif t[1] == 'running' and t[2] == ARGV[3] then
    local ttl = tonumber(ARGV[4])
    redis.call('SET', KEYS[3], ARGV[3], 'PX', ttl)
    redis.call('ZADD', KEYS[4], ms + ttl, ARGV[5])
    lease = 'ok'
  elseif t[1] == 'running' and t[3] == ARGV[3] then
    redis.call('HSET', KEYS[5], 'backup_until', ms + tonumber(ARGV[4]))  -- a backup copy's lease
    lease = 'ok'
  else
    lease = 'lost'
  end
end
return {registered, lease, ms, 1}
