-- ARGV: outcome ('compensated' | 'escalated' | 'completed' | 'failed_to_start'), reason,
--       owner (of the unwind that concludes; a stale chain, or a message with no owner, must
--       not conclude)
-- Ends a run once. 'completed' needs a running run with nothing in flight, 'failed_to_start'
-- a running run that never reserved a step ('started' otherwise); the others close an
-- unwinding run whose compensations have all been tried: an undo pushed after the chain
-- was sent (an effect that landed late) is still pending, and the owner must send it first.
-- The run's keys expire only once its SQL record is written (mark_recorded).
local state = redis.call('HGET', RUN, 'state')
if not state then return {'unknown'} end
if ARGV[1] == 'completed' or ARGV[1] == 'failed_to_start' then
  if state ~= 'running' then return {'ended', state} end
  if ARGV[1] == 'failed_to_start' and redis.call('HGET', RUN, 'next_step') ~= '0' then
    return {'started'}
  end
  if redis.call('HLEN', INFLIGHT) > 0 then return {'inflight', unpack(redis.call('HKEYS', INFLIGHT))} end
elseif state ~= 'unwinding' then
  return {'ended', state}
elseif ARGV[3] == '' or redis.call('HGET', RUN, 'owner') ~= ARGV[3] then
  return {'stale'}
elseif redis.call('HGET', RUN, 'pivot') == '' then
  local fields = redis.call('HGETALL', COMPS)
  local pending = {}
  for i = 1, #fields, 2 do
    local m = string.match(fields[i], '^(%d+):state$')
    if m and (fields[i + 1] == 'pending' or fields[i + 1] == 'running') then
      table.insert(pending, m)
    end
  end
  if #pending > 0 then return {'pending', unpack(pending)} end
end
local events = {completed = 'complete', compensated = 'compensate', escalated = 'escalate',
  failed_to_start = 'fail_to_start'}
local to = move('run', state, events[ARGV[1]] or '')
if not to or to ~= ARGV[1] then return illegal('run', state, events[ARGV[1]] or ARGV[1]) end
redis.call('HSET', RUN, 'state', to, 'ended', NOW_S, 'recorded', '0')
if ARGV[2] ~= '' then
  -- Keep what set the run failing ("step 4 failed", "aborted: ...") beside the verdict.
  local run = redis.call('HMGET', RUN, 'reason', 'cause')
  if (not run[2] or run[2] == '') and run[1] ~= ARGV[2] then
    redis.call('HSET', RUN, 'cause', run[1])
  end
  redis.call('HSET', RUN, 'reason', ARGV[2])
end
bump()
return {'ok', redis.call('HGET', RUN, 'version')}
