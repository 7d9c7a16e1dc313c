-- ARGV: step, now. Check before running (a redelivery replays the recorded outcome).
local n = ARGV[1]
local run_state = redis.call('HGET', RUN, 'state')
if not run_state then return {'unknown'} end
local st = redis.call('HGET', STEPS, n .. ':state')
if not st then return {'unknown'} end
if st == 'succeeded' then
  -- Resume an unwind this step came to own and never sent (its worker died in between).
  local run = redis.call('HMGET', RUN, 'owner', 'sent')
  local mine = (run[1] == 'step:' .. n and run[2] == '0') and 1 or 0
  return {'succeeded', redis.call('HGET', STEPS, n .. ':result'), mine}
end
if st == 'failed' then return {'failed', redis.call('HGET', STEPS, n .. ':error')} end
if st == 'skipped' or st == 'not_dispatched' or st == 'in_doubt' then return {st} end
if st == 'dispatched' and run_state ~= 'running' then
  -- Never started, and the run is already failing: running it now would only add work to undo.
  redis.call('HSET', STEPS, n .. ':state', 'skipped')
  redis.call('HDEL', INFLIGHT, n)
  bump(ARGV[2])
  notify()
  return {'skip', maybe_own('step:' .. n)}
end
redis.call('HSET', STEPS, n .. ':state', 'running', n .. ':started', ARGV[2])
local attempts = redis.call('HINCRBY', STEPS, n .. ':attempts', 1)
return {'run', attempts}
