-- ARGV: step, most (how many times a step may be sent again), delta ('1': about to send,
--       '-1': the send failed, the count is taken back)
-- The reaper is about to send again the message of a step no delivery is on: one no delivery
-- began, or one whose attempt failed and whose retry has not begun by the end of its hold
-- (record_retry released its claim). A broker that lost its messages (one without persistence,
-- restarted) leaves such a step with nobody to run it. Count the send, so that a step whose
-- message never reaches a worker (a queue nobody consumes) is judged in the end (never
-- started, or in doubt) instead of being sent forever.
-- Not progress: the run's version and 'updated' stay, so its deadline still counts from the
-- last real change. A count lost in a failover costs one more message, which the task's
-- check-before-run makes harmless.
local n = ARGV[1]
local step = redis.call('HMGET', STEPS, n .. ':state', n .. ':resent', n .. ':claim', n .. ':lease')
local sent = tonumber(step[2]) or 0
if ARGV[3] == '-1' then
  if sent > 0 then redis.call('HSET', STEPS, n .. ':resent', sent - 1) end
  return {'taken_back', math.max(sent - 1, 0)}
end
local retry_due = step[1] == 'running' and (step[3] or '') == ''
  and (tonumber(step[4]) or 0) < NOW
if step[1] ~= 'dispatched' and not retry_due then return {'state', step[1] or ''} end
if sent >= tonumber(ARGV[2]) then return {'spent', sent} end
redis.call('HSET', STEPS, n .. ':resent', sent + 1)
return {'sent', sent + 1}
