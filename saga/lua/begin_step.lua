-- ARGV: step, tool, args_json, claim, lease_seconds
-- Check before running: a redelivery replays the recorded outcome. The message must be the
-- reserved step's (same tool, same arguments). A delivery holds a lease for as long as it may
-- run: another delivery of the same step meanwhile is told to come back later ('busy').
local n = ARGV[1]
local run_state = redis.call('HGET', RUN, 'state')
if not run_state then return {'unknown'} end
local st = redis.call('HGET', STEPS, n .. ':state')
if not st then return {'unknown'} end
local reserved = redis.call('HMGET', STEPS, n .. ':tool', n .. ':args')
if reserved[1] ~= ARGV[2] or reserved[2] ~= ARGV[3] then
  return {'mismatch', reserved[1] or ''}
end
local owner = 'step:' .. n
if st == 'succeeded' then
  local late = redis.call('HGET', STEPS, n .. ':landed') == 'late'
    and redis.call('HGET', RUN, 'recorded') == '0'
  return {'succeeded', redis.call('HGET', STEPS, n .. ':result'), still_mine(owner), late and 1 or 0}
end
if st == 'failed' then
  return {'failed', redis.call('HGET', STEPS, n .. ':error') or '', still_mine(owner)}
end
if st == 'rejected' then
  return {'rejected', redis.call('HGET', STEPS, n .. ':error') or '', still_mine(owner)}
end
if st == 'skipped' then
  -- Skipped by an earlier delivery (or by this one, its reply lost): if that call came to own
  -- the unwind and its chain was never sent, this one sends it.
  return {'skip', still_mine(owner)}
end
if st == 'dispatched' and run_state ~= 'running' then
  -- Never started, and the run is already failing: running it now would only add work to undo.
  redis.call('HSET', STEPS, n .. ':state', move('step', st, 'skip'))
  redis.call('HDEL', INFLIGHT, n)
  bump()
  notify()
  return {'skip', maybe_own(owner)}
end
local to = move('step', st, 'begin')
if not to then return {st} end  -- not_dispatched, in_doubt: nothing to run
local prior = redis.call('HGET', STEPS, n .. ':claim')
if st == 'running' and prior == ARGV[4] then
  -- This very delivery again (its first reply was lost): what the first call decided.
  return {'run', tonumber(redis.call('HGET', STEPS, n .. ':attempts')),
    redis.call('HGET', STEPS, n .. ':on_failure') or '',
    redis.call('HGET', STEPS, n .. ':orphaned') or '0'}
end
local busy = leased(STEPS, n)
if busy then return {'busy', string.format('%.3f', busy)} end
if st == 'running' and prior and prior ~= '' then
  -- An earlier delivery began the step and vanished without an outcome (a retry clears the
  -- claim; only a death leaves it): whatever that delivery did may have happened.
  redis.call('HSET', STEPS, n .. ':orphaned', '1')
end
redis.call('HSET', STEPS, n .. ':state', to, n .. ':started', NOW_S, n .. ':claim', ARGV[4],
  n .. ':lease', string.format('%.6f', NOW + tonumber(ARGV[5])))
local attempts = redis.call('HINCRBY', STEPS, n .. ':attempts', 1)
bump()
-- How a final failure of this step is recorded: 'feed_back' (the agent is told; the run goes
-- on) or '' (the run unwinds); and whether an earlier delivery died in it ('1'), so that a
-- final failure of this one cannot tell that nothing happened.
return {'run', attempts, redis.call('HGET', STEPS, n .. ':on_failure') or '',
  redis.call('HGET', STEPS, n .. ':orphaned') or '0'}
