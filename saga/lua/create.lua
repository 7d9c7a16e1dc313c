-- ARGV: now, allow_after_pivot, deadline_seconds
if redis.call('EXISTS', RUN) == 1 then return 0 end
redis.call('HSET', RUN, 'state', 'running', 'version', 0, 'next_step', 0, 'pivot', '',
  'reason', '', 'owner', '', 'sent', '0', 'generation', 0, 'created', ARGV[1],
  'updated', ARGV[1], 'ended', '', 'allow_after_pivot', ARGV[2], 'deadline', ARGV[3],
  'doubt', '')
return 1
