-- ARGV: owner. The broker refused the unwind ``owner`` owns, still unsent: say so in the run,
-- so that the request that made it, sent again, sends the unwind instead of being refused as
-- another request (operations.requeue). Cleared by nothing: a later owner is another name.
if redis.call('HGET', RUN, 'owner') ~= ARGV[1] or redis.call('HGET', RUN, 'sent') ~= '0' then
  return 0
end
redis.call('HSET', RUN, 'refused', ARGV[1])
return 1
