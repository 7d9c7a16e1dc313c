-- ARGV: step, now, task_id, unwind (the owner whose chain sent this message; '' to skip)
-- Check before running: a compensation confirmed done is never run again, one given up on
-- runs again only through a requeue, and a message from an unwind that was since taken over
-- (a stale chain coming back late) runs nothing. The task id is kept for operators (revoke).
local n = ARGV[1]
local cs = redis.call('HGET', COMPS, n .. ':state')
if not cs then return {'unknown'} end
if cs == 'done' or cs == 'failed' then return {cs} end
if redis.call('HGET', RUN, 'state') ~= 'unwinding' then return {'ended'} end
if ARGV[4] ~= '' and redis.call('HGET', RUN, 'owner') ~= ARGV[4] then return {'stale'} end
redis.call('HSET', COMPS, n .. ':state', 'running', n .. ':task_id', ARGV[3])
local attempts = redis.call('HINCRBY', COMPS, n .. ':attempts', 1)
return {'run', attempts, redis.call('HGET', COMPS, n .. ':entry')}
