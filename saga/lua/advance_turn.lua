-- ARGV: turn, or '' and a step (the turn is then the one the step's call belongs to)
-- A turn is done once the run still runs, nothing is in flight, and every call of its answer
-- is refused or has its step: mark it so ('next'), first writer wins. Exactly one caller gets
-- {'ok', turn}, and it sends the next turn; the others, and any caller too early, {'no'}.
-- A call waiting for a person's approval has neither, so its turn waits for the decision.
local turn = ARGV[1]
if turn == '' then
  local marker = redis.call('HGET', STEPS, ARGV[2] .. ':call')
  if not marker then return {'no'} end  -- a step of run.call
  turn = string.match(marker, '^(%d+):')
end
if redis.call('HLEN', INFLIGHT) > 0 then return {'no'} end
if redis.call('HGET', RUN, 'state') ~= 'running' then return {'no'} end
local fields = redis.call('HMGET', AGENT, turn .. ':calls', turn .. ':advanced', turn .. ':answer')
if fields[2] or not fields[3] then return {'no'} end
local calls = tonumber(fields[1])
if not calls then calls = #(cjson.decode(fields[3])['calls'] or {}) end
for i = 0, calls - 1 do
  local marker = turn .. ':' .. i
  if redis.call('HEXISTS', STEPS, 'call:' .. marker) == 0
      and redis.call('HEXISTS', AGENT, marker .. ':refused') == 0 then
    return {'no'}
  end
end
redis.call('HSET', AGENT, turn .. ':advanced', 'next')
return {'ok', tonumber(turn)}
