-- ARGV: step, verdict ('found' | 'not_found' | 'unknown'), result_json, entry_json,
--       irreversible ('0'/'1'), doubt_reason ('' unless the run must escalate)
-- What the lookup found decides what the unwind does: a found effect is pushed and undone
-- like any other, a missing one needs nothing, an unknown one is handed to a person.
local n = ARGV[1]
local st = redis.call('HGET', STEPS, n .. ':state')
if st ~= 'in_doubt' or redis.call('HEXISTS', INFLIGHT, n) == 0 then
  -- Settled already (by this caller's first try, its reply lost, maybe): what it decided.
  return {'dup', still_mine('step:' .. n)}
end
local to = move('step', st, ARGV[2])
if not to then return illegal('step', st, ARGV[2]) end
local words = {found = 'happened', not_found = 'not_happened', unknown = 'unknown'}
redis.call('HSET', STEPS, n .. ':state', to, n .. ':reconciled', words[ARGV[2]], n .. ':claim', '')
if ARGV[2] == 'found' then
  redis.call('HSET', STEPS, n .. ':result', ARGV[3])
  push_undo(n, ARGV[4])
end
if ARGV[5] == '1' and ARGV[2] ~= 'not_found' and redis.call('HGET', RUN, 'pivot') == '' then
  redis.call('HSET', RUN, 'pivot', n)
end
if ARGV[6] ~= '' and redis.call('HGET', RUN, 'doubt') == '' then
  redis.call('HSET', RUN, 'doubt', ARGV[6])
end
redis.call('HDEL', INFLIGHT, n)
bump()
notify()
return {'ok', maybe_own('step:' .. n)}
