-- ARGV: step, now. Check before running: a compensation confirmed done is never run again.
local n = ARGV[1]
local cs = redis.call('HGET', COMPS, n .. ':state')
if not cs then return {'unknown'} end
if cs == 'done' then return {'done'} end
redis.call('HSET', COMPS, n .. ':state', 'running')
local attempts = redis.call('HINCRBY', COMPS, n .. ':attempts', 1)
return {'run', attempts, redis.call('HGET', COMPS, n .. ':entry')}
