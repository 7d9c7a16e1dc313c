-- ARGV: allow_after_pivot, deadline_seconds, agent, input_json, run_id. KEYS[7]: the index of
-- runs by creation time (saga:created). Returns 1 if created, 0 if the run exists. With an
-- agent, the hosted loop's hash is created in the same step, so a run of an agent never exists
-- without knowing which agent it is; the run is indexed in the same step too, scored with the
-- very time its hash says it was created (what a listing's cursor compares).
local CREATED = KEYS[7]
if redis.call('EXISTS', RUN) == 1 then return 0 end
redis.call('HSET', RUN, 'state', 'running', 'version', 0, 'next_step', 0, 'pivot', '',
  'reason', '', 'owner', '', 'sent', '0', 'generation', 0, 'created', NOW_S,
  'updated', NOW_S, 'ended', '', 'allow_after_pivot', ARGV[1], 'deadline', ARGV[2],
  'doubt', '', 'recorded', '')
if ARGV[3] and ARGV[3] ~= '' then
  redis.call('HSET', AGENT, 'name', ARGV[3], 'input', ARGV[4], 'created', NOW_S,
    'model_calls', 0, 'tokens_in', 0, 'tokens_out', 0, 'bytes', string.len(ARGV[4]))
end
redis.call('ZADD', CREATED, NOW_S, ARGV[5])
return 1
