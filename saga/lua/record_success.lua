-- ARGV: step, result_json, entry_json ('' when nothing to undo), irreversible ('0'/'1'), now
-- The result, the push and the pivot land together or not at all; a repeat changes nothing.
local n = ARGV[1]
local st = redis.call('HGET', STEPS, n .. ':state')
if st == 'succeeded' then return {'dup', 0} end
-- An in-doubt step that turns out to have succeeded is settled by the truth. So is one that
-- was reconciled as "not happened" and then landed after all: its undo must not be lost.
local late = st == 'failed' and redis.call('HGET', STEPS, n .. ':reconciled') == 'not_happened'
if st ~= 'running' and st ~= 'dispatched' and st ~= 'in_doubt' and not late then
  return {'conflict', st}
end
if late then redis.call('HSET', STEPS, n .. ':reconciled', 'landed_late') end
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
local run_state = redis.call('HGET', RUN, 'state')
if late and (run_state == 'compensated' or run_state == 'completed' or run_state == 'escalated') then
  -- The run ended without this effect: reopen it as escalated, the undo on its stack, so a
  -- person sees it and requeue_failed_compensations can run it.
  redis.call('HSET', RUN, 'state', 'escalated', 'cause', 'step ' .. n .. ' landed after the run ended',
    'reason', 'compensation failed')
  for _, key in ipairs({RUN, STEPS, INFLIGHT, STACK, COMPS}) do redis.call('PERSIST', key) end
  return {'late', 0}
end
return {'ok', maybe_own('step:' .. n)}
