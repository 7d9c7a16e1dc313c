-- ARGV: turn, lease_ms, token, most. KEYS[7]: the turn's lease (saga.constants.turn_lease_key).
-- One delivery of a turn asks the model at a time: a redelivery while a slow model still
-- answers the first must wait for that answer, not ask again. Taking the lease and counting
-- the policy call are one step, so a count never lacks its lease nor a lease its count. The
-- lease holds the asker's token: only it may renew or release it (saga/agents/lease.py).
-- ARGV[4]: the most policy calls a turn may make (0: no limit). The limit is judged here,
-- under the lease, not from the caller's picture: a delivery that read the count while
-- another was still asking must wait for that call's answer, not end the run under it.
-- An answer recorded since the caller read the run: nothing to ask (the caller plays again).
if redis.call('HEXISTS', AGENT, ARGV[1] .. ':answer') == 1 then return {'answered'} end
-- The same asker again (its reply lost, or its write not yet on a replica): counted once.
if redis.call('GET', KEYS[7]) == ARGV[3] then return {'ok'} end
if not redis.call('SET', KEYS[7], ARGV[3], 'NX', 'PX', ARGV[2]) then return {'busy'} end
local asked = tonumber(redis.call('HGET', AGENT, ARGV[1] .. ':asked') or '0')
if tonumber(ARGV[4] or '0') > 0 and asked >= tonumber(ARGV[4]) then
  redis.call('DEL', KEYS[7])
  return {'spent', asked}
end
redis.call('HINCRBY', AGENT, 'model_calls', 1)
redis.call('HINCRBY', AGENT, ARGV[1] .. ':asked', 1)
return {'ok'}
