-- ARGV: version (the one the SQL record describes), retention_seconds, notify ('1': wake
--       whoever waits for the run's end, KEYS[7]; the caller of run.finish() needs no signal),
--       and, with KEYS[8], the run's id and how many seconds from now the reaper looks again.
-- KEYS[8], when given: the reaper's index shard of the run (one Redis: the same server; on a
--       cluster it is another slot, and the caller writes the entry itself).
-- The record of an ended run is written: from now its keys may expire. A run that moved on
-- since (an effect landed late) keeps them until its new record is written.
local run = redis.call('HMGET', RUN, 'state', 'version')
if not run[1] then return {'unknown'} end
local ended = {completed = true, compensated = true, escalated = true, failed_to_start = true}
if not ended[run[1]] then
  return {'moved', run[1]}
end
if run[2] ~= ARGV[1] then return {'moved', run[1]} end
-- recorded_version: what keys that went back in time lack (saga.core.Core.behind_records).
redis.call('HSET', RUN, 'recorded', '1', 'recorded_version', ARGV[1])
-- The hosted loop's hash (transcript, turns) goes with the run: its SQL record holds it too.
for _, key in ipairs({RUN, STEPS, INFLIGHT, STACK, COMPS, AGENT}) do
  redis.call('EXPIRE', key, ARGV[2])
end
if ARGV[3] == '1' then notify() end
-- The reaper's next look: once the keys have expired, to drop the run from the index.
if KEYS[8] then redis.call('ZADD', KEYS[8], NOW + tonumber(ARGV[5]), ARGV[4]) end
return {'ok'}
