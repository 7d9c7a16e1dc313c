-- ARGV: deadline_seconds. A hosted run created by a web app that could not know its agent's
-- deadline (no worker had published the agents yet) ran on the app's default; the turn
-- worker, which hosts the agent, puts the agent's own in its place, once, before anything
-- in the run (an approval, the reaper) is judged by it. Returns the run's 'updated' (the
-- caller moves the reaper's index to the new due time), or 'done' if already adopted.
if redis.call('HGET', AGENT, 'deadline_open') ~= '1' then return {'done'} end
redis.call('HSET', RUN, 'deadline', ARGV[1])
redis.call('HDEL', AGENT, 'deadline_open')
return {'ok', redis.call('HGET', RUN, 'updated')}
