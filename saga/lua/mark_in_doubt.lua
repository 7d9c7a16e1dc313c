-- ARGV: step, error_json, event ('doubt' | 'revoke'), respect_lease ('0'/'1')
-- Nobody knows whether the effect happened. The step stays unsettled (in flight) until it is
-- reconciled, so no unwind can start without it. A revoke decides from the recorded state: a
-- step no delivery began never ran (failed); one that began is in doubt. A step whose
-- delivery still holds its lease may still be running: with respect_lease, leave it be.
local n = ARGV[1]
local owner = 'step:' .. n
local st = redis.call('HGET', STEPS, n .. ':state')
if not st then return {'unknown'} end
if ARGV[3] == 'revoke' and st == 'dispatched' then
  redis.call('HSET', STEPS, n .. ':state', move('step', st, 'never_started'), n .. ':error', ARGV[2])
  redis.call('HDEL', INFLIGHT, n)
  run_fails('step ' .. n .. ' revoked')
  bump()
  notify()
  return {'failed', maybe_own(owner)}
end
if st == 'in_doubt' then
  return {'in_doubt', leased(STEPS, n) and 1 or 0}
end
local to = move('step', st, 'doubt')
if not to then return {'settled', st} end
local busy = leased(STEPS, n)
if busy and ARGV[4] == '1' then return {'busy', string.format('%.3f', busy)} end
redis.call('HSET', STEPS, n .. ':state', to, n .. ':error', ARGV[2])
run_fails('step ' .. n .. ' in doubt')
bump()
return {'in_doubt', busy and 1 or 0}
