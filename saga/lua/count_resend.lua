-- ARGV: step, most (how many times a step may be sent again), delta ('1': about to send,
--       '-1': the send failed, the count is taken back)
-- The reaper is about to send again the message of a step no delivery began (a broker that
-- lost its messages: one without persistence, restarted). Count it, so that a step whose
-- message never reaches a worker (a queue nobody consumes) is judged never started in the end.
-- Not progress: the run's version and 'updated' stay, so its deadline still counts from the
-- last real change. A count lost in a failover costs one more message, which the task's
-- check-before-run makes harmless.
local n = ARGV[1]
local step = redis.call('HMGET', STEPS, n .. ':state', n .. ':resent')
local sent = tonumber(step[2]) or 0
if ARGV[3] == '-1' then
  if sent > 0 then redis.call('HSET', STEPS, n .. ':resent', sent - 1) end
  return {'taken_back', math.max(sent - 1, 0)}
end
if step[1] ~= 'dispatched' then return {'state', step[1] or ''} end
if sent >= tonumber(ARGV[2]) then return {'spent', sent} end
redis.call('HSET', STEPS, n .. ':resent', sent + 1)
return {'sent', sent + 1}
