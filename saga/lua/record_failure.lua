-- ARGV: step, error_json, now
-- Starting the unwind is fenced: two failures, or the same failure delivered twice, start one.
local n = ARGV[1]
local owner = 'step:' .. n
local st = redis.call('HGET', STEPS, n .. ':state')
if st == 'failed' then
  -- A redelivered errback: resume only an unwind this very step owned and never sent.
  local mine = redis.call('HGET', RUN, 'owner') == owner and redis.call('HGET', RUN, 'sent') == '0'
  return {'dup', mine and 1 or 0}
end
if st ~= 'running' and st ~= 'dispatched' and st ~= 'in_doubt' then return {'conflict', st} end
redis.call('HSET', STEPS, n .. ':state', 'failed', n .. ':error', ARGV[2])
redis.call('HDEL', INFLIGHT, n)
if redis.call('HGET', RUN, 'state') == 'running' then
  redis.call('HSET', RUN, 'state', 'unwinding', 'reason', 'step ' .. n .. ' failed')
end
bump(ARGV[3])
notify()
return {'ok', maybe_own(owner)}
