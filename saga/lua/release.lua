-- ARGV: step, error_json, now. The broker refused the task: the step never ran.
local n = ARGV[1]
if redis.call('HGET', STEPS, n .. ':state') ~= 'dispatched' then return {'dup'} end
redis.call('HSET', STEPS, n .. ':state', 'not_dispatched', n .. ':error', ARGV[2])
redis.call('HDEL', INFLIGHT, n)
bump(ARGV[3])
notify()
return {'ok', maybe_own('step:' .. n)}
