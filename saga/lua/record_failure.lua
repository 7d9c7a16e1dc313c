-- ARGV: step, error_json, event ('fail' | 'never_started' | 'reject'); and, for a 'fail' whose
--       unwind's first message was prepared (saga/forward.py, saga/prepared_publish.py): the
--       run's version it was made from, the chain's id and the message, pushed to the queue
--       KEYS[8] (the broker is this Redis) and marked sent, as mark_sent.lua does, only if this
--       record makes the step the unwind's owner and the run is still at that version (the
--       chain was made from the run as this record leaves it).
-- {'ok', owns the unwind, turn done} (see the end), 'dup', 'began', 'unknown' or illegal.
-- 'never_started' is the reaper's or a revoke's verdict and holds only for a step no delivery
-- began; 'fail' is the worker's, after the tool's retries. Starting the unwind is fenced:
-- two failures, or the same failure delivered twice, start one. 'reject' is the worker's too:
-- the tool refused (ToolRejected) or failed in a way its agent feeds back to the model;
-- nothing happened and the run goes on (it may still owe an unwind started meanwhile).
local n = ARGV[1]
local owner = 'step:' .. n
local unmoved = ARGV[6] and ARGV[3] == 'fail' and redis.call('HGET', RUN, 'version') == ARGV[4]
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
local owns = maybe_own(owner)
local turn = advance_turn_of(n)
if owns == 1 and unmoved then
  redis.call('LPUSH', KEYS[8], ARGV[6])
  redis.call('HSET', RUN, 'sent', '1', 'sent_chain', ARGV[5])
  return {'ok', owns, turn, 1}
end
return {'ok', owns, turn}
