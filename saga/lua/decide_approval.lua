-- ARGV: call marker ('<turn>:<call>'), verdict ('approved' | 'denied'), by, reason, args_hash
-- A person decides a hosted call that waits for approval. Single use: the first decision
-- stands. Bound to the arguments: the hash must be the one of the call as the model asked it.
-- Expiring with the run: past its deadline since the request (Redis clock), or once the turn
-- recorded the request as expired (expire_approval.lua), no decision is taken.
local field = ARGV[1] .. ':approval'
local pending = redis.call('HGET', AGENT, field)
if not pending then return {'unknown'} end
local decided = redis.call('HGET', AGENT, ARGV[1] .. ':decision')
if decided then
  -- A repeat of this very decision (its answer was lost, or the broker refused the turn that
  -- acts on it) gets what the first one decided and the run's state: while it runs, its
  -- caller sends that turn again.
  local d = cjson.decode(decided)
  if d.verdict == ARGV[2] and d.by == ARGV[3] and d.reason == ARGV[4] and d.args_hash == ARGV[5]
  then
    return {'repeat', decided, redis.call('HGET', RUN, 'state') or ''}
  end
  return {'decided', decided}
end
local state = redis.call('HGET', RUN, 'state')
if state ~= 'running' then return {'ended', state or ''} end
local request = cjson.decode(pending)
if request.args_hash ~= ARGV[5] then return {'mismatch'} end
if redis.call('HEXISTS', AGENT, ARGV[1] .. ':refused') == 1 then return {'expired'} end
local deadline = tonumber(redis.call('HGET', RUN, 'deadline') or '0')
if NOW > tonumber(request.requested_at) + deadline then return {'expired'} end
local decision = cjson.encode({verdict = ARGV[2], by = ARGV[3], reason = ARGV[4],
  args_hash = ARGV[5], at = NOW})
redis.call('HSET', AGENT, ARGV[1] .. ':decision', decision)
bump()
return {'ok', decision}
