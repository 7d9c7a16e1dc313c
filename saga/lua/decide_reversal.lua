-- ARGV: step, decision ('reverse' | 'keep' | 'later' | 'expire'), hash (of the asked undo, as
--       the person was shown it; '' for 'expire'), by, note, owner (of the unwind that goes on
--       after 'reverse', 'keep' or 'expire'), later_seconds (for 'later': the new deadline)
-- A person answers the question an undo's reversal policy asked (begin_compensation): reverse
-- it now (back to pending, approved: the new owner's chain runs it, then the older ones), keep
-- the effect (kept, on the books; the older ones run), or decide later (a new deadline). The
-- answer is bound to the undo it was asked of (its entry's hash) and single-use: a second
-- answer gets 'decided' with the first. 'expire' is the reaper's, once the deadline passed with
-- no answer: the undo fails ("a person was asked and did not answer"), so the run escalates.
-- Every decision is kept ('<n>:decisions'), the last reverse or keep as '<n>:decision'.
local n, decision = ARGV[1], ARGV[2]
local cs = redis.call('HGET', COMPS, n .. ':state')
if not cs then return {'unknown'} end
local state = redis.call('HGET', RUN, 'state')
if cs ~= 'asked' then return {'decided', cs, redis.call('HGET', COMPS, n .. ':decision') or ''} end
if state ~= 'unwinding' then return {'ended', state or ''} end
local expires = redis.call('HGET', COMPS, n .. ':ask_expires') or '0'
if decision == 'expire' then
  if tonumber(expires) > NOW then return {'waiting', expires} end
elseif redis.call('HGET', COMPS, n .. ':ask_hash') ~= ARGV[3] then
  return {'mismatch'}
end
local to = move('comp', cs, decision)
if not to then return illegal('comp', cs, decision) end
local made = {decision = decision, by = ARGV[4], note = ARGV[5], at = NOW_S}
local decisions = cjson.decode(redis.call('HGET', COMPS, n .. ':decisions') or '[]')
table.insert(decisions, made)
redis.call('HSET', COMPS, n .. ':decisions', cjson.encode(decisions))
if decision == 'later' then
  local until_ = string.format('%.6f', NOW + tonumber(ARGV[7]))
  redis.call('HSET', COMPS, n .. ':ask_expires', until_)
  bump()
  return {'ok', '', until_}
end
if decision == 'expire' then
  local error = cjson.encode({type = 'NotAnswered', message = 'a person was asked whether to '
    .. 'reverse it, and did not answer by ' .. expires})
  redis.call('HSET', COMPS, n .. ':state', to, n .. ':error', error, n .. ':at', NOW_S)
  local errors = cjson.decode(redis.call('HGET', COMPS, n .. ':errors') or '[]')
  table.insert(errors, {error = cjson.decode(error), at = NOW_S})
  redis.call('HSET', COMPS, n .. ':errors', cjson.encode(errors))
else
  redis.call('HSET', COMPS, n .. ':state', to, n .. ':decision', cjson.encode(made),
    n .. ':at', NOW_S)
  if decision == 'reverse' then redis.call('HSET', COMPS, n .. ':approved', '1') end
end
redis.call('HSET', RUN, 'owner', ARGV[6], 'sent', '0')
bump()
return {'ok', ARGV[6], ''}
