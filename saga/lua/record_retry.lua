-- ARGV: step, error_json, hold_seconds (the countdown plus the next attempt's run time)
-- The attempt failed and the task sent its retry: the step stays begun (the failed attempt
-- may have had an effect), its lease is released for the retry, and held long enough that
-- the reaper does not take the wait for a lost step.
local n = ARGV[1]
local st = redis.call('HGET', STEPS, n .. ':state')
local to = move('step', st, 'retry')
if not to then return illegal('step', st, 'retry') end
redis.call('HSET', STEPS, n .. ':state', to, n .. ':error', ARGV[2], n .. ':claim', '',
  n .. ':lease', string.format('%.6f', NOW + tonumber(ARGV[3])))
bump()
return {'ok'}
