-- ARGV: step, error_json, now
-- Nobody knows whether the effect happened. The step stays unsettled (in flight) until it is
-- reconciled, so no unwind can start without it; the run is failing from now on. Waiters
-- are woken by the reconciliation, not here: the verdict is what they need.
local n = ARGV[1]
local st = redis.call('HGET', STEPS, n .. ':state')
if st ~= 'running' and st ~= 'dispatched' then return {'dup', st or ''} end
redis.call('HSET', STEPS, n .. ':state', 'in_doubt', n .. ':error', ARGV[2])
if redis.call('HGET', RUN, 'state') == 'running' then
  redis.call('HSET', RUN, 'state', 'unwinding', 'reason', 'step ' .. n .. ' in doubt')
end
bump(ARGV[3])
return {'ok'}
