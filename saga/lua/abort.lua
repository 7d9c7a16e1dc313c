-- ARGV: reason
local state = redis.call('HGET', RUN, 'state')
if not state then return {'unknown'} end
local to = move('run', state, 'abort')
if not to then
  -- A repeat of this very abort (its reply was lost) gets what the first call decided.
  if state == 'unwinding' and redis.call('HGET', RUN, 'reason') == ARGV[1] then
    return {'ok', still_mine('abort')}
  end
  return {'ended', state}
end
redis.call('HSET', RUN, 'state', to, 'reason', ARGV[1])
bump()
return {'ok', maybe_own('abort')}
