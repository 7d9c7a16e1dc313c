-- ARGV: turn, answer_json, input_tokens, output_tokens, calls (how many the answer makes),
-- token. KEYS[7]: the turn's lease, released if ``token`` still holds it.
-- The hosted loop records the model's answer for a turn: the first writer wins, and a repeat
-- (a redelivered turn, or a duplicate that raced it) gets the recorded answer back instead of
-- acting on its own. Usage is counted once, by the winner. The answer is progress: the
-- reaper must not take a run whose model is thinking for an abandoned one. An answer that
-- comes back once the run has ended (aborted, or reaped as hung, while the model thought) is
-- not kept: the run's record is written, or being written, without it.
local field = ARGV[1] .. ':answer'
if redis.call('GET', KEYS[7]) == ARGV[6] then redis.call('DEL', KEYS[7]) end
redis.call('HDEL', AGENT, ARGV[1] .. ':asker', ARGV[1] .. ':claim')
local had = redis.call('HGET', AGENT, field)
if had then return {'dup', had} end
if redis.call('EXISTS', AGENT) == 0 then return {'unknown'} end
local state = redis.call('HGET', RUN, 'state')
if state ~= 'running' and state ~= 'unwinding' then return {'ended', state or ''} end
redis.call('HSET', AGENT, field, ARGV[2], ARGV[1] .. ':calls', ARGV[5], 'turn', ARGV[1])
redis.call('HINCRBY', AGENT, 'tokens_in', ARGV[3])
redis.call('HINCRBY', AGENT, 'tokens_out', ARGV[4])
redis.call('HINCRBY', AGENT, 'bytes', string.len(ARGV[2]))
progress()
return {'ok', ARGV[2]}
