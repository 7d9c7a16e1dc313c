-- ARGV: turn, results_json
-- What a turn's calls returned, as the next model call reads them: the first writer wins, so
-- every delivery of the next turn (and the transcript) shows the model the same results.
local field = ARGV[1] .. ':results'
if redis.call('HSETNX', AGENT, field, ARGV[2]) == 1 then
  redis.call('HINCRBY', AGENT, 'bytes', string.len(ARGV[2]))
  return {'ok', ARGV[2]}
end
return {'dup', redis.call('HGET', AGENT, field)}
