-- ARGV: step, outcome ('done' | 'failed' | 'retrying'), error_json, now
-- The stack entry goes only once its compensation is confirmed done.
local n = ARGV[1]
local cs = redis.call('HGET', COMPS, n .. ':state')
if not cs then return 'unknown' end
if cs == 'done' then return 'dup' end
if ARGV[2] == 'done' then
  redis.call('LREM', STACK, 1, redis.call('HGET', COMPS, n .. ':entry'))
  redis.call('HSET', COMPS, n .. ':state', 'done', n .. ':at', ARGV[4])
elseif ARGV[2] == 'failed' then
  redis.call('HSET', COMPS, n .. ':state', 'failed', n .. ':error', ARGV[3], n .. ':at', ARGV[4])
else
  redis.call('HSET', COMPS, n .. ':state', 'pending', n .. ':error', ARGV[3])
end
bump(ARGV[4])
return 'ok'
