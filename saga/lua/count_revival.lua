-- The reaper sends a stalled hosted turn again: count it, per stall. A run that made progress
-- since the last revival (its 'updated' moved) starts counting afresh, so a long run that
-- stalls now and then is not abandoned for the stalls it recovered from long ago.
local updated = redis.call('HGET', RUN, 'updated') or ''
if redis.call('HGET', AGENT, 'revived_at') ~= updated then
  redis.call('HSET', AGENT, 'revived', 1, 'revived_at', updated)
  return {'ok', 1}
end
return {'ok', redis.call('HINCRBY', AGENT, 'revived', 1)}
