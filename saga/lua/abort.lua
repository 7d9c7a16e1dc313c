-- ARGV: reason, expected_version ('' to skip: the reaper passes the version it judged the
--       run idle at, so a run that moved on since is not aborted on a stale reading)
local state = redis.call('HGET', RUN, 'state')
if not state then return {'unknown'} end
local to = move('run', state, 'abort')
if not to then
  -- A repeat of this very abort (its reply was lost, or the broker refused its unwind) is
  -- told so, however far the unwind got, and owns the unwind again if the first one's is
  -- still unsent.
  if redis.call('HGET', RUN, 'reason') == ARGV[1] then
    return {'repeat', still_mine('abort')}
  end
  return {'ended', state}
end
if ARGV[2] and ARGV[2] ~= '' and redis.call('HGET', RUN, 'version') ~= ARGV[2] then
  return {'moved'}
end
redis.call('HSET', RUN, 'state', to, 'reason', ARGV[1])
bump()
return {'ok', maybe_own('abort')}
