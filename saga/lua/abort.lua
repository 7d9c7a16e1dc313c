-- ARGV: reason, now
local state = redis.call('HGET', RUN, 'state')
if not state then return {'unknown'} end
if state ~= 'running' then return {'ended', state} end
redis.call('HSET', RUN, 'state', 'unwinding', 'reason', ARGV[1])
bump(ARGV[2])
return {'ok', maybe_own('abort')}
