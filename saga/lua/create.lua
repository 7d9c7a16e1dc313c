-- ARGV: allow_after_pivot, deadline_seconds. Returns 1 if created, 0 if the run exists.
if redis.call('EXISTS', RUN) == 1 then return 0 end
redis.call('HSET', RUN, 'state', 'running', 'version', 0, 'next_step', 0, 'pivot', '',
  'reason', '', 'owner', '', 'sent', '0', 'generation', 0, 'created', NOW_S,
  'updated', NOW_S, 'ended', '', 'allow_after_pivot', ARGV[1], 'deadline', ARGV[2],
  'doubt', '', 'recorded', '')
return 1
