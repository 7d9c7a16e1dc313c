-- ARGV: reason
local state = redis.call('HGET', RUN, 'state')
if not state then return {'unknown'} end
local to = move('run', state, 'abort')
if not to then return {'ended', state} end
redis.call('HSET', RUN, 'state', to, 'reason', ARGV[1])
bump()
return {'ok', maybe_own('abort')}
