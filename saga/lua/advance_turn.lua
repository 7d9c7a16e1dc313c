-- ARGV: turn, or '' and a step (the turn is then the one the step's call belongs to)
-- See advance_turn in the prelude. Exactly one caller gets {'ok', turn}, and it sends the
-- next turn; the others, and any caller too early, {'no'}.
local done
if ARGV[1] == '' then done = advance_turn_of(ARGV[2]) else done = advance_turn(ARGV[1]) end
if done == 0 then return {'no'} end
return {'ok', done}
