-- ARGV: now. Reopen an escalated run whose compensations failed, to run those again.
local state = redis.call('HGET', RUN, 'state')
if not state then return {'unknown'} end
if state ~= 'escalated' or redis.call('HGET', RUN, 'pivot') ~= '' then return {'refused', state} end
local again = 0
for _, entry in ipairs(redis.call('LRANGE', STACK, 0, -1)) do again = again + 1 end
if again == 0 then return {'refused', state} end
local fields = redis.call('HGETALL', COMPS)
for i = 1, #fields, 2 do
  local f, v = fields[i], fields[i + 1]
  if string.sub(f, -6) == ':state' and v == 'failed' then redis.call('HSET', COMPS, f, 'pending') end
end
local generation = redis.call('HINCRBY', RUN, 'generation', 1)
redis.call('HSET', RUN, 'state', 'unwinding', 'owner', 'requeue:' .. generation, 'sent', '0', 'ended', '')
bump(ARGV[1])
for _, key in ipairs(KEYS) do redis.call('PERSIST', key) end
return {'ok', 'requeue:' .. generation}
