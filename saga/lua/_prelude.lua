-- Shared by every script. KEYS: run, steps, inflight, stack, comps (see saga/constants.py).
local RUN, STEPS, INFLIGHT, STACK, COMPS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
-- KEYS[6], when given: the list a client waiting on this step blocks on (BLPOP).
local SETTLED = KEYS[6]

-- Wake whoever waits for this step's outcome; the list expires if nobody does.
local function notify()
  if SETTLED then
    redis.call('RPUSH', SETTLED, '1')
    redis.call('EXPIRE', SETTLED, 300)
  end
end

local function bump(now)
  redis.call('HINCRBY', RUN, 'version', 1)
  redis.call('HSET', RUN, 'updated', now)
end

-- Whoever settles the last step of a failing run owns its unwind: exactly one caller gets 1.
local function maybe_own(owner)
  if redis.call('HGET', RUN, 'state') ~= 'unwinding' then return 0 end
  if redis.call('HLEN', INFLIGHT) > 0 then return 0 end
  if redis.call('HGET', RUN, 'owner') ~= '' then return 0 end
  redis.call('HSET', RUN, 'owner', owner, 'sent', '0')
  return 1
end
