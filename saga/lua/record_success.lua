-- ARGV: step, result_json, entry_json ('' when nothing to undo), irreversible ('0'/'1'), now
-- The result, the push and the pivot land together or not at all; a repeat changes nothing.
local n = ARGV[1]
local st = redis.call('HGET', STEPS, n .. ':state')
if st == 'succeeded' then return {'dup', 0} end
-- An in-doubt step that turns out to have succeeded is settled by the truth.
if st ~= 'running' and st ~= 'dispatched' and st ~= 'in_doubt' then return {'conflict', st} end
redis.call('HSET', STEPS, n .. ':state', 'succeeded', n .. ':result', ARGV[2])
if ARGV[3] ~= '' then
  redis.call('RPUSH', STACK, ARGV[3])
  redis.call('HSET', COMPS, n .. ':state', 'pending', n .. ':attempts', 0, n .. ':entry', ARGV[3])
end
if ARGV[4] == '1' and redis.call('HGET', RUN, 'pivot') == '' then
  redis.call('HSET', RUN, 'pivot', n)
end
redis.call('HDEL', INFLIGHT, n)
bump(ARGV[5])
notify()
return {'ok', maybe_own('step:' .. n)}
