-- ARGV: step, tool, args_json, claim, lease_seconds
-- Check before running: a redelivery replays the recorded outcome. The message must be the
-- reserved step's (same tool, same arguments). A delivery holds a lease for as long as it may
-- run: another delivery of the same step meanwhile is told to come back later ('busy').
local n = ARGV[1]
local run = redis.call('HMGET', RUN, 'state', 'version')
local run_state = run[1]
if not run_state then return {'unknown'} end
-- Everything this script may need of the step, in one read.
local f = redis.call('HMGET', STEPS, n .. ':state', n .. ':tool', n .. ':args', n .. ':claim',
  n .. ':lease', n .. ':on_failure', n .. ':orphaned', n .. ':attempts')
local st, prior, on_failure, orphaned = f[1], f[4], f[6] or '', f[7] or '0'
if not st then return {'unknown'} end
if f[2] ~= ARGV[2] or f[3] ~= ARGV[3] then
  return {'mismatch', f[2] or ''}
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
  bump_from(run[2])
  notify()
  return {'skip', maybe_own(owner)}
end
local to = move('step', st, 'begin')
if not to then return {st} end  -- not_dispatched, in_doubt: nothing to run
if st == 'running' and prior == ARGV[4] then
  -- This very delivery again (its first reply was lost): what the first call decided.
  return {'run', tonumber(f[8]), on_failure, orphaned}
end
-- The lease of another delivery (see leased() in the prelude), from the fields read above.
if prior and prior ~= '' and tonumber(f[5] or '0') > NOW then
  return {'busy', string.format('%.3f', tonumber(f[5]) - NOW)}
end
local attempts = (tonumber(f[8]) or 0) + 1
local fields = {n .. ':state', to, n .. ':started', NOW_S, n .. ':claim', ARGV[4],
  n .. ':lease', string.format('%.6f', NOW + tonumber(ARGV[5])), n .. ':attempts', attempts}
if st == 'running' and prior and prior ~= '' then
  -- An earlier delivery began the step and vanished without an outcome (a retry clears the
  -- claim; only a death leaves it): whatever that delivery did may have happened.
  orphaned = '1'
  table.insert(fields, n .. ':orphaned'); table.insert(fields, '1')
end
redis.call('HSET', STEPS, unpack(fields))
bump_from(run[2])
-- How a final failure of this step is recorded: 'feed_back' (the agent is told; the run goes
-- on) or '' (the run unwinds); and whether an earlier delivery died in it ('1'), so that a
-- final failure of this one cannot tell that nothing happened.
return {'run', attempts, on_failure, orphaned}
