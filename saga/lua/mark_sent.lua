-- ARGV: owner. The unwind's chain is on the broker: a redelivered errback must not send another.
if redis.call('HGET', RUN, 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', RUN, 'sent', '1')
return 1
