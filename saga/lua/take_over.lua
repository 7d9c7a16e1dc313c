-- ARGV: expected_version, new_owner, now
-- The reaper takes over an unwind that made no progress since it looked (same version): its
-- owner died before sending the chain, or the chain was lost. Two reapers: one wins.
if redis.call('HGET', RUN, 'state') ~= 'unwinding' then return 0 end
if redis.call('HGET', RUN, 'version') ~= ARGV[1] then return 0 end
if redis.call('HLEN', INFLIGHT) > 0 then return 0 end
redis.call('HSET', RUN, 'owner', ARGV[2], 'sent', '0')
bump(ARGV[3])
return 1
