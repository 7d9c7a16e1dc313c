-- ARGV: owner; and, when the unwind's first message was prepared (saga/prepared_publish.py):
--       the chain's id (that message's task id) and the message, pushed to the queue KEYS[7]
--       (the broker is this Redis) with the mark, only while ARGV[1] owns the unwind: a chain
--       that exists exactly when it is marked sent. The same call repeated (its command
--       retried on a lost connection) finds its chain's id and pushes nothing more.
-- The unwind's chain is on the broker: a redelivered errback must not send another.
if redis.call('HGET', RUN, 'owner') ~= ARGV[1] then return 0 end
if ARGV[3] then
  if redis.call('HGET', RUN, 'sent_chain') == ARGV[2] then return 1 end
  redis.call('LPUSH', KEYS[7], ARGV[3])
  redis.call('HSET', RUN, 'sent', '1', 'sent_chain', ARGV[2])
  return 1
end
redis.call('HSET', RUN, 'sent', '1')
return 1
