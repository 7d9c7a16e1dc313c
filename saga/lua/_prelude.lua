-- Shared by every script. KEYS: run, steps, inflight, stack, comps, agent (see
-- saga/constants.py; agent is the hosted loop's hash, absent for a run driven by run.call).
local RUN, STEPS, INFLIGHT, STACK, COMPS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local AGENT = KEYS[6]
-- KEYS[7], when given: the list a client waiting on this step blocks on (BLPOP); the hosted
-- loop's scripts (ask_model, record_answer) take the turn's lease there instead.
local SETTLED = KEYS[7]

-- One clock for every host: the Redis server's. Times are stored as seconds with microseconds,
-- written from TIME's own digits: formatting a number costs Redis more than the rest of a
-- small script's clock, and each script takes NOW (the number) only where it compares times.
local TIME = redis.call('TIME')
local NOW_S = TIME[1] .. '.' .. string.sub('00000' .. TIME[2], -6)
local NOW = tonumber(NOW_S)

-- The transition tables of saga/machine.py: a move they do not list is refused, loudly.
-- (MOVES is one string of |machine:source:event=target entries: a plain search finds one.)
local function move(machine, source, event)
  local _, last = string.find(MOVES, '|' .. machine .. ':' .. (source or '') .. ':' .. event
    .. '=', 1, true)
  return last and string.match(MOVES, '^[^|]+', last + 1)
end
local function illegal(machine, source, event)
  return {'illegal', machine, source or '', event}
end

-- Wake whoever waits for this step's outcome; the list expires if nobody does.
local function notify()
  if SETTLED then
    redis.call('RPUSH', SETTLED, '1')
    redis.call('EXPIRE', SETTLED, '300')
  end
end

local function bump()
  redis.call('HINCRBY', RUN, 'version', 1)
  redis.call('HSET', RUN, 'updated', NOW_S)
end

-- The hosted loop moved a running run on (an answer, a refusal, a request for approval, a
-- turn done): progress, so the reaper neither takes it for idle nor acts on a stale reading.
local function progress()
  if redis.call('HGET', RUN, 'state') == 'running' then bump() end
end

-- bump() for a script that has read the run's version already: the version, 'updated' and
-- any other run fields given ({field, value, ...}) in one write.
local function bump_from(version, fields)
  fields = fields or {}
  table.insert(fields, 'version')
  table.insert(fields, (tonumber(version) or 0) + 1)
  table.insert(fields, 'updated')
  table.insert(fields, NOW_S)
  redis.call('HSET', RUN, unpack(fields))
end

-- A lease is held while its claim is set and its time has not run out.
local function leased(hash, n)
  local lease = redis.call('HMGET', hash, n .. ':claim', n .. ':lease')
  if lease[1] and lease[1] ~= '' and tonumber(lease[2] or '0') > NOW then
    return tonumber(lease[2]) - NOW
  end
  return nil
end

-- Whoever settles the last step of a failing run owns its unwind: exactly one caller gets 1.
local function maybe_own(owner)
  if redis.call('HGET', RUN, 'state') ~= 'unwinding' then return 0 end
  if redis.call('HLEN', INFLIGHT) > 0 then return 0 end
  if redis.call('HGET', RUN, 'owner') ~= '' then return 0 end
  redis.call('HSET', RUN, 'owner', owner, 'sent', '0')
  return 1
end

-- Did ``owner`` come to own the unwind and not send its chain yet (a repeat must resume it)?
local function still_mine(owner)
  local run = redis.call('HMGET', RUN, 'owner', 'sent', 'state')
  return (run[3] == 'unwinding' and run[1] == owner and run[2] == '0') and 1 or 0
end

-- A running run whose step failed (or is in doubt) starts failing; the first cause is kept.
local function run_fails(why)
  if redis.call('HGET', RUN, 'state') == 'running' then
    redis.call('HSET', RUN, 'state', move('run', 'running', 'fail'), 'reason', why)
  end
end

local function persist_all()
  for _, key in ipairs({RUN, STEPS, INFLIGHT, STACK, COMPS, AGENT}) do redis.call('PERSIST', key) end
end

local function push_undo(n, entry)
  if entry ~= '' then
    redis.call('RPUSH', STACK, entry)
    redis.call('HSET', COMPS, n .. ':state', 'pending', n .. ':attempts', '0',
      n .. ':round_start', '0', n .. ':entry', entry)
  end
end

-- The hosted loop's turn ``turn`` is done once the run still runs, nothing is in flight, and
-- every call of its answer is refused or has its step: mark it so ('next'), first writer
-- wins. Returns the turn for the one caller that did (it sends the next turn), else 0. A call
-- waiting for a person's approval has neither, so its turn waits for the decision.
local function advance_turn(turn)
  if redis.call('HLEN', INFLIGHT) > 0 then return 0 end
  if redis.call('HGET', RUN, 'state') ~= 'running' then return 0 end
  local fields = redis.call('HMGET', AGENT, turn .. ':calls', turn .. ':advanced', turn .. ':answer')
  if fields[2] or not fields[3] then return 0 end
  local calls = tonumber(fields[1])
  if not calls then calls = #(cjson.decode(fields[3])['calls'] or {}) end
  for i = 0, calls - 1 do
    local marker = turn .. ':' .. i
    if redis.call('HEXISTS', STEPS, 'call:' .. marker) == 0
        and redis.call('HEXISTS', AGENT, marker .. ':refused') == 0 then
      return 0
    end
  end
  redis.call('HSET', AGENT, turn .. ':advanced', 'next')
  bump()
  return tonumber(turn)
end

-- The same, for the turn whose call step ``n`` made (0 for a step of run.call).
local function advance_turn_of(n)
  local marker = redis.call('HGET', STEPS, n .. ':call')
  if not marker or marker == '' then return 0 end
  return advance_turn(string.match(marker, '^(%d+):'))
end
