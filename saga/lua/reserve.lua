-- ARGV: expected_version, tool, class, args_json, now
-- The caller checked the pivot rules against the snapshot it read at expected_version; any
-- change since then makes it read again, so the rules never act on a stale view.
local state = redis.call('HGET', RUN, 'state')
if not state then return {'unknown'} end
if redis.call('HGET', RUN, 'version') ~= ARGV[1] then return {'conflict'} end
if state ~= 'running' then return {'ended', state} end
local n = redis.call('HINCRBY', RUN, 'next_step', 1)
redis.call('HSET', STEPS, n .. ':tool', ARGV[2], n .. ':class', ARGV[3], n .. ':args', ARGV[4],
  n .. ':state', 'dispatched', n .. ':attempts', 0, n .. ':at', ARGV[5])
redis.call('HSET', INFLIGHT, n, ARGV[3])
bump(ARGV[5])
return {'ok', n}
