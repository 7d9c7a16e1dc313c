-- ARGV: corrections ('' or a JSON object: step -> its corrected undo entry, as JSON),
--       version (the run's version the corrections were made from; '' without any),
--       action (JSON: who requeued and what they corrected, kept for the run's record)
-- Reopen an escalated run to run its failed (and never run) compensations again, each with a
-- fresh attempt budget; earlier attempts stay counted in 'attempts' and listed in 'history'.
-- Claims stay: an execution revoked while running keeps its lease, and the requeued attempt
-- waits ('busy') until that lease has run out instead of undoing beside it.
-- A run a person resolved (at its current version) is theirs: it is not requeued.
local state = redis.call('HGET', RUN, 'state')
if not state then return {'unknown'} end
local run = redis.call('HMGET', RUN, 'resolved', 'version', 'resolution')
if run[1] and run[1] ~= '' and run[1] == run[2] then return {'resolved', run[3]} end
local to = move('run', state, 'requeue')
if not to or redis.call('HGET', RUN, 'pivot') ~= '' then return {'refused', state} end
if redis.call('LLEN', STACK) == 0 then return {'refused', state} end
if ARGV[2] ~= '' and ARGV[2] ~= run[2] then return {'moved', run[2]} end
-- Corrections are checked whole before anything is written: all of them apply, or none.
local corrections = {}
if ARGV[1] ~= '' then
  for n, entry in pairs(cjson.decode(ARGV[1])) do
    local cs = redis.call('HGET', COMPS, n .. ':state')
    local at = cs and move('comp', cs, 'requeue')
      and redis.call('LPOS', STACK, redis.call('HGET', COMPS, n .. ':entry'))
    if not at then return {'uncorrectable', n, cs or ''} end
    corrections[n] = {at, entry}
  end
end
for n, c in pairs(corrections) do
  redis.call('LSET', STACK, c[1], c[2])
  redis.call('HSET', COMPS, n .. ':entry', c[2])
end
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
local action = 'requeue:' .. generation
redis.call('HSET', RUN, 'state', to, 'owner', action, 'sent', '0',
  'ended', '', 'recorded', '', action, ARGV[3], action .. ':at', NOW_S, action .. ':count', again)
bump()
persist_all()
return {'ok', action, again}
