-- Shared by conclude.lua and record_compensation.lua (saga/store_scripts.py adds it to both):
-- the run's end, made once. outcome: 'compensated' | 'escalated' | 'completed' |
-- 'failed_to_start'; why: the reason; owner: of the unwind that concludes (a stale chain, or a
-- message with no owner, must not conclude); expected: nil, '' or the version the caller
-- judged the run at ('moved' if it is not there now).
-- {'ok', version, ended, reason, cause}: what the conclusion wrote, so a caller holding the
-- run as it was at the version it passed knows the run as it is now without reading it again.
-- 'completed' needs a running run with nothing in flight, 'failed_to_start' a running run
-- that never reserved a step ('started' otherwise); the others close an unwinding run whose
-- compensations have all been tried: an undo pushed after the chain was sent (an effect that
-- landed late) is still pending, and the owner must send it first. The run's keys expire only
-- once its SQL record is written (mark_recorded).
local function conclude_run(outcome, why, owner, expected)
  local run = redis.call('HMGET', RUN, 'state', 'version', 'reason', 'cause', 'owner', 'pivot')
  local state, version, reason, cause = run[1], run[2], run[3] or '', run[4] or ''
  if not state then return {'unknown'} end
  if outcome == 'completed' or outcome == 'failed_to_start' then
    if state ~= 'running' then return {'ended', state} end
    if outcome == 'failed_to_start' and redis.call('HGET', RUN, 'next_step') ~= '0' then
      return {'started'}
    end
    if redis.call('HLEN', INFLIGHT) > 0 then
      return {'inflight', unpack(redis.call('HKEYS', INFLIGHT))}
    end
  elseif state ~= 'unwinding' then
    return {'ended', state}
  elseif owner == '' or run[5] ~= owner then
    return {'stale'}
  elseif expected and expected ~= '' and version ~= expected then
    return {'moved'}
  elseif run[6] == '' then
    local fields = redis.call('HGETALL', COMPS)
    local pending = {}
    for i = 1, #fields, 2 do
      local m = string.match(fields[i], '^(%d+):state$')
      if m and fields[i + 1] == 'asked' then
        return {'asked', m}  -- a person decides first: the unwind waits, nothing concludes
      end
      if m and (fields[i + 1] == 'pending' or fields[i + 1] == 'running') then
        table.insert(pending, m)
      end
    end
    if #pending > 0 then return {'pending', unpack(pending)} end
  end
  local events = {completed = 'complete', compensated = 'compensate', escalated = 'escalate',
    failed_to_start = 'fail_to_start'}
  local to = move('run', state, events[outcome] or '')
  if not to or to ~= outcome then return illegal('run', state, events[outcome] or outcome) end
  -- recorded_version: an end these keys reached, whose record may be written before it is
  -- marked (a requeue in between reopens from it): saga.divergence.
  local fields = {'state', to, 'ended', NOW_S, 'recorded', '0',
    'recorded_version', tostring((tonumber(version) or 0) + 1)}
  if why ~= '' then
    -- Keep what set the run failing ("step 4 failed", "aborted: ...") beside the verdict.
    if cause == '' and reason ~= why then
      cause = reason
      table.insert(fields, 'cause'); table.insert(fields, cause)
    end
    reason = why
    table.insert(fields, 'reason'); table.insert(fields, reason)
  end
  bump_from(version, fields)
  return {'ok', tostring((tonumber(version) or 0) + 1), NOW_S, reason, cause}
end
