-- ARGV: allow_after_pivot, deadline_seconds, agent, input_json, created (seconds, the score
-- the caller indexed the run with in saga:created), deadline_open ('1': the deadline is a web
-- app's default, to be replaced by the agent's own when its turn worker first plays it:
-- adopt_deadline.lua). Returns 1 if created, 0 if the run exists. With an agent, the hosted loop's hash is created in the same step, so a run of an
-- agent never exists without knowing which agent it is. The indexes (outside the run's hash
-- tag) are written by the caller, before this script, in the same round trip.
if redis.call('EXISTS', RUN) == 1 then return 0 end
local created = ARGV[5]
redis.call('HSET', RUN, 'state', 'running', 'version', '0', 'next_step', '0', 'pivot', '',
  'reason', '', 'owner', '', 'sent', '0', 'generation', '0', 'created', created,
  'updated', created, 'ended', '', 'allow_after_pivot', ARGV[1], 'deadline', ARGV[2],
  'doubt', '', 'recorded', '', 'recorded_version', '0')
if ARGV[3] and ARGV[3] ~= '' then
  redis.call('HSET', AGENT, 'name', ARGV[3], 'input', ARGV[4], 'created', created,
    'model_calls', '0', 'tokens_in', '0', 'tokens_out', '0', 'bytes', string.len(ARGV[4]))
  if ARGV[6] == '1' then redis.call('HSET', AGENT, 'deadline_open', '1') end
end
return 1
