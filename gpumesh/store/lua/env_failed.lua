-- env_failed: a worker could not build a job's environment (gpumesh/envs). It names the env in its hash's
-- 'env_failed' (dispatch gives it that job's tasks no more: env_state), and the job learns the builder's message
-- ('env_error') and whether another live worker may still build it ('env_dead' '0'), or none may ('1': each
-- failed worker then leases the job's tasks and fails them with the message, as failures of kind environment).
-- A worker that may run the job: registered and live, it builds envs, meets one of the job's requirement
-- classes, trusts its signer, its lender accepts it, and its machine has not failed this env.
--
-- env_failed(
--   keys = {job hash, worker hash, scores zset (the live workers), idle set},
--   args = {worker id, the env's lock digest, the builder's message}
-- )
-- Reply: {1, 'waiting', 'by', a worker that may still build it}, {1, 'dead'}, or {0, 'stale'} when the job
-- has no such env (gone, or another env).

local job_key, worker_key, scores_key, idle_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local worker_id, env, message = ARGV[1], ARGV[2], ARGV[3]

local failed = redis.pcall('HGET', worker_key, 'env_failed')
if type(failed) ~= 'table' and not env_listed(failed, env) then
  local list = type(failed) == 'string' and failed ~= '' and (failed .. ',') or ''
  redis.pcall('HSET', worker_key, 'env_failed', list .. string.sub(env, 1, ENV_SHORT))
end
local job = redis.pcall('HMGET', job_key, 'env', 'classes', 'key_id', 'timeout', 'submitter')
if type(job) ~= 'table' or job.err or job[1] ~= env then
  return {0, 'stale'}
end
redis.call('HSET', job_key, 'env_error', string.sub(message, 1, 4000))
local ok, classes = pcall(cjson.decode, job[2] or '')
if not ok or type(classes) ~= 'table' then
  classes = {{}}
end
for _, id in ipairs(redis.call('ZRANGE', scores_key, 0, 1999)) do
  local w = id ~= worker_id and redis.pcall('HMGET', PREFIX .. 'worker:' .. id, 'resources', 'env_failed')
  if type(w) == 'table' and not w.err and type(w[1]) == 'string' and #w[1] <= 65536
      and not env_listed(w[2], env) then
    local fine, res = pcall(cjson.decode, w[1])
    if fine and type(res) == 'table' and res['envs'] ~= 'no' and accepts_signer(res, job[3])
        and lender_accepts(res, job[4], job[5]) then
      for _, reqs in ipairs(classes) do
        local meets_ok, meets = pcall(meets_all, type(reqs) == 'table' and reqs or {}, res)
        if meets_ok and meets then
          redis.call('HSET', job_key, 'env_dead', '0')
          return {1, 'waiting', 'by', id}
        end
      end
    end
  end
end
redis.call('HSET', job_key, 'env_dead', '1')
wake_idle(idle_key)  -- the workers that left the job to others: they fail its tasks now
return {1, 'dead'}
