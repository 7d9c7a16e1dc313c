-- ARGV: call marker ('<turn>:<call>'), message.
-- A hosted call that is not dispatched (unknown tool, bad arguments, the pivot rules, a
-- person's denial): why, fed back to the model. First writer wins; a refusal is progress.
if redis.call('HSETNX', AGENT, ARGV[1] .. ':refused', ARGV[2]) == 0 then return {'dup'} end
progress()
return {'ok'}
