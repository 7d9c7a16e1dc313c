-- ARGV: allow_after_pivot, deadline_seconds[, agent, input_json]. Returns 1 if created, 0 if
-- the run exists. With an agent, the hosted loop's hash is created in the same step, so a run
-- of an agent never exists without knowing which agent it is.
if redis.call('EXISTS', RUN) == 1 then return 0 end
redis.call('HSET', RUN, 'state', 'running', 'version', 0, 'next_step', 0, 'pivot', '',
  'reason', '', 'owner', '', 'sent', '0', 'generation', 0, 'created', NOW_S,
  'updated', NOW_S, 'ended', '', 'allow_after_pivot', ARGV[1], 'deadline', ARGV[2],
  'doubt', '', 'recorded', '')
if ARGV[3] and ARGV[3] ~= '' then
  redis.call('HSET', AGENT, 'name', ARGV[3], 'input', ARGV[4], 'created', NOW_S,
    'model_calls', 0, 'tokens_in', 0, 'tokens_out', 0, 'bytes', string.len(ARGV[4]))
end
return 1
