-- ARGV: outcome ('compensated' | 'escalated' | 'completed'), reason, now, retention_seconds,
--       owner (of the unwind that concludes; '' to skip: a stale chain must not conclude)
-- Ends a run once. 'completed' needs a running run with nothing in flight; the others close an
-- unwinding run. Ended runs keep their keys for the retention period, then expire.
local state = redis.call('HGET', RUN, 'state')
if not state then return {'unknown'} end
if ARGV[1] == 'completed' then
  if state ~= 'running' then return {'ended', state} end
  if redis.call('HLEN', INFLIGHT) > 0 then return {'inflight', unpack(redis.call('HKEYS', INFLIGHT))} end
elseif state ~= 'unwinding' then
  return {'ended', state}
elseif ARGV[5] and ARGV[5] ~= '' and redis.call('HGET', RUN, 'owner') ~= ARGV[5] then
  return {'stale'}
end
redis.call('HSET', RUN, 'state', ARGV[1], 'ended', ARGV[3])
if ARGV[2] ~= '' then
  -- Keep what set the run failing ("step 4 failed", "aborted: ...") beside the verdict.
  local cause = redis.call('HGET', RUN, 'reason')
  if cause ~= ARGV[2] then redis.call('HSET', RUN, 'cause', cause) end
  redis.call('HSET', RUN, 'reason', ARGV[2])
end
bump(ARGV[3])
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[4]) end
return {'ok'}
