-- ARGV: step, outcome ('done' | 'fail' | 'retry' | 'revoke'), error_json, claim, owner
-- The stack entry goes only once its compensation is confirmed done. 'done' is the truth and
-- is taken from whoever ran it; 'fail' and 'retry' only from the execution holding the claim;
-- 'revoke' only for the current owner's unwind (a stale revoke changes nothing).
local n, outcome = ARGV[1], ARGV[2]
local cs = redis.call('HGET', COMPS, n .. ':state')
if not cs then return {'unknown'} end
if cs == 'done' then return {'dup'} end
if outcome == 'fail' and cs == 'failed' then return {'dup'} end
local to = move('comp', cs, outcome)
if not to then return illegal('comp', cs, outcome) end
if (outcome == 'fail' or outcome == 'retry') and cs == 'running'
    and redis.call('HGET', COMPS, n .. ':claim') ~= ARGV[4] then
  return {'stale'}
end
if outcome == 'revoke' and redis.call('HGET', RUN, 'owner') ~= ARGV[5] then return {'stale'} end
if to == 'done' then
  redis.call('LREM', STACK, 1, redis.call('HGET', COMPS, n .. ':entry'))
  redis.call('HSET', COMPS, n .. ':state', to, n .. ':at', NOW_S, n .. ':claim', '')
elseif to == 'failed' and outcome == 'revoke' and cs == 'running' then
  -- Revoked while running: the execution may still be undoing (a revoke does not stop a
  -- running task; a terminate takes a moment). Its claim stays, so its lease keeps a requeued
  -- attempt waiting ('busy') until it has run out.
  redis.call('HSET', COMPS, n .. ':state', to, n .. ':error', ARGV[3], n .. ':at', NOW_S)
elseif to == 'failed' then
  redis.call('HSET', COMPS, n .. ':state', to, n .. ':error', ARGV[3], n .. ':at', NOW_S,
    n .. ':claim', '')
else
  redis.call('HSET', COMPS, n .. ':state', to, n .. ':error', ARGV[3], n .. ':claim', '')
end
bump()
return {'ok'}
