-- ARGV: step, verdict ('happened' | 'not_happened' | 'unknown'), result_json, entry_json,
--       irreversible ('0'/'1'), doubt_reason ('' unless the run must escalate), now
-- What the lookup found decides what the unwind does: a found effect is pushed and undone
-- like any other, a missing one needs nothing, an unknown one is handed to a person.
local n = ARGV[1]
if redis.call('HGET', STEPS, n .. ':state') ~= 'in_doubt' then return {'dup', 0} end
redis.call('HSET', STEPS, n .. ':reconciled', ARGV[2])
if ARGV[2] == 'happened' then
  redis.call('HSET', STEPS, n .. ':state', 'succeeded', n .. ':result', ARGV[3])
  if ARGV[4] ~= '' then
    redis.call('RPUSH', STACK, ARGV[4])
    redis.call('HSET', COMPS, n .. ':state', 'pending', n .. ':attempts', 0, n .. ':entry', ARGV[4])
  end
elseif ARGV[2] == 'not_happened' then
  redis.call('HSET', STEPS, n .. ':state', 'failed')
end
if ARGV[5] == '1' and ARGV[2] ~= 'not_happened' and redis.call('HGET', RUN, 'pivot') == '' then
  redis.call('HSET', RUN, 'pivot', n)
end
if ARGV[6] ~= '' and redis.call('HGET', RUN, 'doubt') == '' then
  redis.call('HSET', RUN, 'doubt', ARGV[6])
end
redis.call('HDEL', INFLIGHT, n)
bump(ARGV[7])
notify()
return {'ok', maybe_own('step:' .. n)}
