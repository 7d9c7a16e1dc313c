-- ARGV: step, outcome ('done' | 'fail' | 'retry' | 'revoke'), error_json, claim, owner
-- (for 'revoke', claim 'killed' says the execution died with SIGKILL: its lease ends now),
-- and, when the unwind's next message was prepared (saga/prepared_publish.py), that message
-- ('' for none), pushed to the queue KEYS[7] (the broker is this Redis) if this records the undo
-- done: the chain is passed on exactly when the undo is recorded. And, for the unwind's last
-- undo, a conclusion judged beforehand (saga/compensation.py): outcome, reason, owner and the
-- version of the run it was judged on as this record would leave it. If this records the
-- undo done on that version, its entry taken off the stack, the run is concluded by this same
-- script (_conclude_run.lua): {'ok', what the conclusion answered...}.
-- The stack entry goes only once its compensation is confirmed done. 'done' is the truth and
-- is taken from whoever ran it; 'fail' and 'retry' only from the execution holding the claim;
-- 'revoke' only for the current owner's unwind (a stale revoke changes nothing).
-- Every error recorded is also appended to '<n>:errors' (the last ERRORS_KEPT, across requeues),
-- so the escalation shows each attempt's error, not only the last one's.
local ERRORS_KEPT = 20
local n, outcome = ARGV[1], ARGV[2]

local function keep_error(error_json)
  if error_json == '' then return end
  local errors = cjson.decode(redis.call('HGET', COMPS, n .. ':errors') or '[]')
  -- (Kept as text if Lua's decoder refuses it: recording the outcome must never fail on it.)
  local ok, decoded = pcall(cjson.decode, error_json)
  table.insert(errors, {error = ok and decoded or error_json, at = NOW_S})
  while #errors > ERRORS_KEPT do table.remove(errors, 1) end
  redis.call('HSET', COMPS, n .. ':errors', cjson.encode(errors))
end

local cs = redis.call('HGET', COMPS, n .. ':state')
if not cs then return {'unknown'} end
if cs ~= 'running' and ARGV[4] ~= '' and redis.call('HGET', COMPS, n .. ':claim') == ARGV[4] then
  -- The execution revoked while running reports its end: it runs no more, so its lease (kept
  -- to hold back a requeued attempt) is over. What it reports was decided by the revoke.
  redis.call('HSET', COMPS, n .. ':claim', '')
  if outcome ~= 'done' then return {'stale'} end
end
if cs == 'done' then return {'dup'} end
if outcome == 'fail' and cs == 'failed' then return {'dup'} end
if outcome == 'retry' and cs == 'pending' and ARGV[4] ~= ''
    and redis.call('HGET', COMPS, n .. ':retried_by') == ARGV[4] then
  return {'dup'}  -- this execution's retry again (its first reply was lost)
end
local to = move('comp', cs, outcome)
if not to then return illegal('comp', cs, outcome) end
if (outcome == 'fail' or outcome == 'retry') and cs == 'running'
    and redis.call('HGET', COMPS, n .. ':claim') ~= ARGV[4] then
  return {'stale'}
end
if outcome == 'revoke' and redis.call('HGET', RUN, 'owner') ~= ARGV[5] then return {'stale'} end
local removed = 0
if to == 'done' then
  removed = redis.call('LREM', STACK, 1, redis.call('HGET', COMPS, n .. ':entry'))
  redis.call('HSET', COMPS, n .. ':state', to, n .. ':at', NOW_S, n .. ':claim', '')
  if ARGV[6] and ARGV[6] ~= '' then redis.call('LPUSH', KEYS[7], ARGV[6]) end
elseif to == 'failed' and outcome == 'revoke' and cs == 'running' and ARGV[4] ~= 'killed' then
  -- Revoked while running: the execution may still be undoing (a revoke does not stop a
  -- running task; a terminate takes a moment). Its claim stays, so its lease keeps a requeued
  -- attempt waiting ('busy') until it has run out.
  redis.call('HSET', COMPS, n .. ':state', to, n .. ':error', ARGV[3], n .. ':at', NOW_S)
elseif to == 'failed' then
  redis.call('HSET', COMPS, n .. ':state', to, n .. ':error', ARGV[3], n .. ':at', NOW_S)
  -- Only the running execution's claim ends here. A message that never began (revoked in the
  -- queue) leaves alone a claim an earlier execution, revoked while running, still holds: its
  -- lease keeps the next requeued attempt from undoing beside it.
  if cs == 'running' then redis.call('HSET', COMPS, n .. ':claim', '') end
  keep_error(ARGV[3])
else  -- retry: the claim is released for the next attempt; who retried is kept for a repeat
  redis.call('HSET', COMPS, n .. ':state', to, n .. ':error', ARGV[3], n .. ':claim', '',
    n .. ':retried_by', ARGV[4])
  keep_error(ARGV[3])
end
bump()
-- (Judged with the undo's entry off the stack: only if it was there to take off.)
if to == 'done' and ARGV[10] and removed == 1 then
  return {'ok', unpack(conclude_run(ARGV[7], ARGV[8], ARGV[9], ARGV[10]))}
end
return {'ok'}
