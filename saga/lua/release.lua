-- ARGV: step, error_json. The broker refused the message: release the step, unless a
-- delivery already began it (the publish did land after all): then say so, with its state.
local n = ARGV[1]
local st = redis.call('HGET', STEPS, n .. ':state')
if not st then return {'unknown'} end
local to = move('step', st, 'release')
if not to then return {'started', st} end
redis.call('HSET', STEPS, n .. ':state', to, n .. ':error', ARGV[2])
redis.call('HDEL', INFLIGHT, n)
bump()
notify()
return {'ok', maybe_own('step:' .. n)}
