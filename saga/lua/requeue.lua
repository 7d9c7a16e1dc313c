-- Reopen an escalated run to run its failed (and never run) compensations again, each with a
-- fresh attempt budget; earlier attempts stay counted in 'attempts' and listed in 'history'.
-- Claims stay: an execution revoked while running keeps its lease, and the requeued attempt
-- waits ('busy') until that lease has run out instead of undoing beside it.
local state = redis.call('HGET', RUN, 'state')
if not state then return {'unknown'} end
local to = move('run', state, 'requeue')
if not to or redis.call('HGET', RUN, 'pivot') ~= '' then return {'refused', state} end
if redis.call('LLEN', STACK) == 0 then return {'refused', state} end
local fields = redis.call('HGETALL', COMPS)
local again = 0
for i = 1, #fields, 2 do
  local n = string.match(fields[i], '^(%d+):state$')
  if n and move('comp', fields[i + 1], 'requeue') then
    local attempts = redis.call('HGET', COMPS, n .. ':attempts') or '0'
    local history = cjson.decode(redis.call('HGET', COMPS, n .. ':history') or '[]')
    if fields[i + 1] == 'failed' then
      table.insert(history, {attempts = tonumber(attempts), error = redis.call('HGET', COMPS, n .. ':error'),
        at = redis.call('HGET', COMPS, n .. ':at')})
    end
    redis.call('HSET', COMPS, n .. ':state', move('comp', fields[i + 1], 'requeue'),
      n .. ':round_start', attempts, n .. ':history', cjson.encode(history))
    again = again + 1
  end
end
if again == 0 then return {'refused', state} end
local generation = redis.call('HINCRBY', RUN, 'generation', 1)
redis.call('HSET', RUN, 'state', to, 'owner', 'requeue:' .. generation, 'sent', '0',
  'ended', '', 'recorded', '')
bump()
persist_all()
return {'ok', 'requeue:' .. generation, again}
