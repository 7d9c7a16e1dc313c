-- ARGV: step, claim (this execution), task_id (for operators), unwind (the owner whose chain
--       sent this message), lease_seconds, ask_seconds (how long a person has to decide, when
--       the undo's entry says its reversal asks one: 'ask' {expires, hash} then, nothing run)
-- Check before running: a compensation confirmed done is never run again, one given up on
-- runs again only through a requeue, and a message from any unwind but the current owner's
-- (a stale chain, or one with no owner) runs nothing. While another execution holds its
-- lease, or a newer step's compensation is still running (or was revoked while running and
-- its execution has not reported), this one waits ('busy').
local n = ARGV[1]
local cs = redis.call('HGET', COMPS, n .. ':state')
if not cs then return {'unknown'} end
if cs == 'done' or cs == 'failed' or cs == 'kept' then return {cs} end
if cs == 'asked' then return {'asked', redis.call('HGET', COMPS, n .. ':ask_expires') or ''} end
if redis.call('HGET', RUN, 'state') ~= 'unwinding' then return {'ended'} end
if ARGV[4] == '' or redis.call('HGET', RUN, 'owner') ~= ARGV[4] then return {'stale'} end
if cs == 'running' and redis.call('HGET', COMPS, n .. ':claim') == ARGV[2] then
  -- This very execution again (its first reply was lost): what the first call decided.
  local first = tonumber(redis.call('HGET', COMPS, n .. ':round_start') or '0')
  return {'run', tonumber(redis.call('HGET', COMPS, n .. ':attempts')) - first,
    redis.call('HGET', COMPS, n .. ':entry')}
end
local busy = leased(COMPS, n)
if busy then return {'busy', string.format('%.3f', busy)} end
local fields = redis.call('HGETALL', COMPS)
for i = 1, #fields, 2 do
  -- A newer undo still running under its lease (or revoked while running: its execution may
  -- still be undoing, and keeps its claim until it reports) goes first: undos run newest first.
  local m = string.match(fields[i], '^(%d+):state$')
  if m and tonumber(m) > tonumber(n) and fields[i + 1] ~= 'done' then
    local newer = leased(COMPS, m)
    if newer then return {'busy', string.format('%.3f', newer)} end
  end
end
local entry = nil
if cs == 'pending' then
  -- Its tool's reversal policy asks a person first (judged when the undo was pushed): the
  -- unwind stops here, the newer undos done, the older ones waiting their turn. The question
  -- is bound to this very entry (its hash): a decision on another undo cannot answer it.
  -- (The entry is read here once, for the answer below too: no command more per undo.)
  entry = redis.call('HGET', COMPS, n .. ':entry')
  local ok, decoded = false, nil
  if string.find(entry, '"ask":true', 1, true) then ok, decoded = pcall(cjson.decode, entry) end
  if ok and type(decoded) == 'table' and decoded.ask == true
      and redis.call('HGET', COMPS, n .. ':approved') ~= '1' then
    local asked = move('comp', cs, 'ask')
    if not asked then return illegal('comp', cs, 'ask') end
    local expires = string.format('%.6f', NOW + tonumber(ARGV[6] or '86400'))
    local hash = redis.sha1hex(entry)
    redis.call('HSET', COMPS, n .. ':state', asked, n .. ':asked_at', NOW_S,
      n .. ':ask_expires', expires, n .. ':ask_hash', hash)
    bump()
    return {'ask', expires, hash}
  end
end
local to = move('comp', cs, 'begin')
if not to then return illegal('comp', cs, 'begin') end
redis.call('HSET', COMPS, n .. ':state', to, n .. ':task_id', ARGV[3], n .. ':claim', ARGV[2],
  n .. ':started', NOW_S, n .. ':lease', string.format('%.6f', NOW + tonumber(ARGV[5])))
local attempts = redis.call('HINCRBY', COMPS, n .. ':attempts', 1)
local first = tonumber(redis.call('HGET', COMPS, n .. ':round_start') or '0')
bump()
return {'run', attempts - first, entry or redis.call('HGET', COMPS, n .. ':entry')}
