-- ARGV: step, result_json, entry_json ('' when nothing to undo), irreversible ('0'/'1'),
--       problem_json ('' or absent: none), fails ('' or absent; else the reason the run fails)
-- A problem (the result could not be recorded, the undo could not be built) is kept as the
-- succeeded step's error, and ``fails`` sets a running run failing, in the same script as the
-- push: a redelivery finds the step settled and the run failing, never one without the other.
-- {'ok', owns the unwind, late, turn done}: the last is only there when this settling
-- checked the step's turn (the turn it completed, or 0); a repeat leaves the check to its
-- caller, since the first call's caller may have died before sending the next turn.
-- The result, the push and the pivot land together or not at all. A repeat (its first reply
-- was lost) answers what the first call decided: who owns the unwind, whether it was late.
-- An effect that lands on a step already judged (failed, skipped, in doubt and settled) is
-- never dropped: it is pushed, and unwound if the run can still unwind, else escalated.
local n = ARGV[1]
local owner = 'step:' .. n
local f = redis.call('HMGET', STEPS, n .. ':state', n .. ':call')
local st = f[1]
if not st then return {'unknown'} end
if st == 'succeeded' then
  local late = redis.call('HGET', STEPS, n .. ':landed') == 'late'
    and redis.call('HGET', RUN, 'recorded') == '0'
  return {'dup', still_mine(owner), late and 1 or 0}
end
local to = move('step', st, 'succeed')
if not to then return illegal('step', st, 'succeed') end
local judged = st ~= 'running' and st ~= 'dispatched'
  and not (st == 'in_doubt' and redis.call('HEXISTS', INFLIGHT, n) == 1)
redis.call('HSET', STEPS, n .. ':state', to, n .. ':result', ARGV[2], n .. ':claim', '')
if ARGV[5] and ARGV[5] ~= '' then redis.call('HSET', STEPS, n .. ':error', ARGV[5]) end
push_undo(n, ARGV[3])
local run = redis.call('HMGET', RUN, 'pivot', 'version', 'state')
bump_from(run[2], (ARGV[4] == '1' and run[1] == '') and {'pivot', n} or nil)
if ARGV[6] and ARGV[6] ~= '' then
  run_fails(ARGV[6])
  run[3] = redis.call('HGET', RUN, 'state')
end
redis.call('HDEL', INFLIGHT, n)
notify()
if not judged then
  -- Only a failing run has an unwind to own; a step of a hosted turn may be the turn's last:
  -- the 4th value says (see advance_turn; the step's call marker was read above).
  local own = run[3] == 'unwinding' and maybe_own(owner) or 0
  local turn = 0
  if f[2] and f[2] ~= '' then turn = advance_turn(string.match(f[2], '^(%d+):')) end
  return {'ok', own, 0, turn}
end
redis.call('HSET', STEPS, n .. ':landed', 'late')
local run_state = redis.call('HGET', RUN, 'state')
if run_state == 'running' or run_state == 'unwinding' then
  -- Still failing: the undo is on the stack; the unwind's conclusion sends it if its chain
  -- was already on its way.
  return {'ok', maybe_own(owner), 0}
end
-- The run ended without this effect: reopen it. A compensated run unwinds this one too; any
-- other ends escalated with the effect on its card. Keys stay until the record says so.
persist_all()
local cause = 'step ' .. n .. ' landed after the run ended ' .. run_state
if run_state == 'compensated' and redis.call('HGET', RUN, 'pivot') == '' then
  redis.call('HSET', RUN, 'state', move('run', run_state, 'late'), 'cause', cause,
    'owner', owner, 'sent', '0', 'ended', '', 'recorded', '')
  return {'late', 1, 1}
end
local target = move('run', run_state, 'late')
redis.call('HSET', RUN, 'state', target, 'cause', cause, 'recorded', '0',
  'reason', 'an effect landed after the run ended')
return {'late', 0, 1}
