-- ARGV: step, error_json, event ('fail' | 'never_started' | 'reject')
-- {'ok', owns the unwind, turn done} (see the end), 'dup', 'began', 'unknown' or illegal.
-- 'never_started' is the reaper's or a revoke's verdict and holds only for a step no delivery
-- began; 'fail' is the worker's, after the tool's retries. Starting the unwind is fenced:
-- two failures, or the same failure delivered twice, start one. 'reject' is the worker's too:
-- the tool refused (ToolRejected) or failed in a way its agent feeds back to the model;
-- nothing happened and the run goes on (it may still owe an unwind started meanwhile).
local n = ARGV[1]
local owner = 'step:' .. n
local st = redis.call('HGET', STEPS, n .. ':state')
if not st then return {'unknown'} end
if st == 'failed' and ARGV[3] == 'fail' then return {'dup', still_mine(owner)} end
if st == 'rejected' and ARGV[3] == 'reject' then return {'dup', still_mine(owner)} end
if ARGV[3] == 'never_started' and st ~= 'dispatched' then
  -- The verdict came from a reading a moment old: a delivery has begun (or settled) the step
  -- since. Expected, not illegal: the verdict simply does not hold.
  return {'began', st}
end
local to = move('step', st, ARGV[3])
if not to then return illegal('step', st, ARGV[3]) end
redis.call('HSET', STEPS, n .. ':state', to, n .. ':error', ARGV[2], n .. ':claim', '')
local judged = redis.call('HDEL', INFLIGHT, n) == 0
if ARGV[3] ~= 'reject' then run_fails('step ' .. n .. ' failed') end
bump()
notify()
-- The 3rd value, as record_success's 4th: the hosted turn this settling completed, or 0
-- (a repeat above leaves that check to its caller).
if judged then return {'ok', 0, advance_turn_of(n)} end
return {'ok', maybe_own(owner), advance_turn_of(n)}
