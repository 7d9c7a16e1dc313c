-- ARGV: step, error_json, event ('fail' | 'never_started')
-- 'never_started' is the reaper's or a revoke's verdict and holds only for a step no delivery
-- began; 'fail' is the worker's, after the tool's retries. Starting the unwind is fenced:
-- two failures, or the same failure delivered twice, start one.
local n = ARGV[1]
local owner = 'step:' .. n
local st = redis.call('HGET', STEPS, n .. ':state')
if not st then return {'unknown'} end
if st == 'failed' and ARGV[3] == 'fail' then return {'dup', still_mine(owner)} end
local to = move('step', st, ARGV[3])
if not to then return illegal('step', st, ARGV[3]) end
redis.call('HSET', STEPS, n .. ':state', to, n .. ':error', ARGV[2], n .. ':claim', '')
local judged = redis.call('HDEL', INFLIGHT, n) == 0
run_fails('step ' .. n .. ' failed')
bump()
notify()
if judged then return {'ok', 0} end
return {'ok', maybe_own(owner)}
