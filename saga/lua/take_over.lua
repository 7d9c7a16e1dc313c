-- ARGV: expected_version, new_owner
-- The reaper takes over an unwind that made no progress since it looked (same version): its
-- owner died before sending the chain, or the chain was lost. A compensation still running
-- under its lease is progress, not a stall. Two reapers: one wins.
local state = redis.call('HGET', RUN, 'state')
if not move('run', state, 'take_over') then return {'refused', state or ''} end
-- The same taker again (its reply lost, or its write not yet on a replica): it owns the
-- unwind still, nothing sent yet.
if redis.call('HGET', RUN, 'owner') == ARGV[2] and redis.call('HGET', RUN, 'sent') == '0' then
  return {'ok'}
end
if redis.call('HGET', RUN, 'version') ~= ARGV[1] then return {'moved'} end
if redis.call('HLEN', INFLIGHT) > 0 then return {'inflight'} end
local fields = redis.call('HGETALL', COMPS)
for i = 1, #fields, 2 do
  local m = string.match(fields[i], '^(%d+):state$')
  if m and fields[i + 1] == 'running' and leased(COMPS, m) then return {'busy', m} end
end
redis.call('HSET', RUN, 'owner', ARGV[2], 'sent', '0')
bump()
return {'ok'}
