-- ARGV: step, now, task_id. Check before running: a compensation confirmed done is never
-- run again. The Celery task id is kept so an operator can find (or revoke) it.
local n = ARGV[1]
local cs = redis.call('HGET', COMPS, n .. ':state')
if not cs then return {'unknown'} end
if cs == 'done' then return {'done'} end
redis.call('HSET', COMPS, n .. ':state', 'running', n .. ':task_id', ARGV[3] or '')
local attempts = redis.call('HINCRBY', COMPS, n .. ':attempts', 1)
return {'run', attempts, redis.call('HGET', COMPS, n .. ':entry')}
