-- ARGV: generation (of the escalation being resolved), resolution (JSON: by, note, its id)
-- A person closes the run's current escalation by hand: from now it refuses a requeue. The
-- mark holds at the run's version: an effect that lands later reopens the escalation. The run
-- is to be recorded again (its escalation row resolved), so the reaper sees to that if the
-- caller cannot.
local run = redis.call('HMGET', RUN, 'state', 'generation', 'resolved', 'version', 'resolution',
  'resolved_at')
if not run[1] then return {'unknown'} end
if run[1] ~= 'escalated' then return {'state', run[1]} end
if run[2] ~= ARGV[1] then return {'stale', run[2]} end
if run[3] and run[3] ~= '' and run[3] == run[4] then return {'resolved', run[5], run[6]} end
redis.call('HSET', RUN, 'resolved', run[4], 'resolution', ARGV[2], 'resolved_at', NOW_S,
  'recorded', '0')
-- Kept until the new record is written (mark_recorded lets them expire again).
persist_all()
return {'ok', run[4]}
