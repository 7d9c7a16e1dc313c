-- ARGV: tool, class, args_json, unsettled_classes (comma list), before_pivot ('0'/'1'),
--       marker ('' or the hosted loop's "<turn>:<call>"), on_failure ('' | 'feed_back'),
--       and, when the caller prepared the step's message (saga/prepared_publish.py): the step
--       it was made for, and the message, pushed to the queue KEYS[7] (the broker is this
--       Redis) only if that is the step reserved; {'ok', n, 'sent'} then. Otherwise the
--       caller sends it once the script has answered, as it does without one.
-- The gate (which classes must have settled, whether the run must be before its pivot)
-- comes from saga/rules.py; this script only checks it atomically and reserves the step.
-- A refusal changes nothing; the caller explains it from a fresh view.
-- A marker is recorded with the step, in the same script: a call reserved once under a
-- marker is never reserved again ('dup' answers the step it got), so a turn that crashed
-- between reserving and sending can look its calls up and resume them.
local run = redis.call('HMGET', RUN, 'state', 'allow_after_pivot', 'pivot', 'next_step', 'version')
local state = run[1]
if not state then return {'unknown'} end
local marker = ARGV[6] or ''
if marker ~= '' then
  local had = redis.call('HGET', STEPS, 'call:' .. marker)
  if had then return {'dup', had} end
end
if state ~= 'running' then return {'ended', state} end
local before_pivot = ARGV[5] == '1' and run[2] ~= '1'
if before_pivot and run[3] ~= '' then return {'refused'} end
if ARGV[4] ~= '' or before_pivot then  -- (a gate with nothing to check reads nothing more)
  local blocking = {}
  for class in string.gmatch(ARGV[4], '[^,]+') do blocking[class] = true end
  local inflight = redis.call('HGETALL', INFLIGHT)
  for i = 2, #inflight, 2 do
    if blocking[inflight[i]] or (before_pivot and inflight[i] == '5') then return {'refused'} end
  end
end
-- The step's number, written once: Redis formats a number each time one is joined to a
-- string or passed to a command.
local step = tonumber(run[4]) + 1
local n = tostring(step)
local fields = {n .. ':tool', ARGV[1], n .. ':class', ARGV[2], n .. ':args', ARGV[3],
  n .. ':state', 'dispatched', n .. ':attempts', '0', n .. ':at', NOW_S}
if marker ~= '' then
  table.insert(fields, 'call:' .. marker); table.insert(fields, n)
  table.insert(fields, n .. ':call'); table.insert(fields, marker)
end
if ARGV[7] and ARGV[7] ~= '' then
  table.insert(fields, n .. ':on_failure'); table.insert(fields, ARGV[7])
end
redis.call('HSET', STEPS, unpack(fields))
redis.call('HSET', INFLIGHT, n, ARGV[2])
bump_from(run[5], {'next_step', n})
if ARGV[8] and tonumber(ARGV[8]) == step then
  redis.call('LPUSH', KEYS[7], ARGV[9])
  return {'ok', step, 'sent'}
end
return {'ok', step}
