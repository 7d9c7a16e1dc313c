-- ARGV: turn, lease_ms, token. KEYS[7]: the turn's lease (saga.constants.turn_lease_key).
-- One delivery of a turn asks the model at a time: a redelivery while a slow model still
-- answers the first must wait for that answer, not ask again. Taking the lease and counting
-- the policy call are one step, so a count never lacks its lease nor a lease its count. The
-- lease holds the asker's token: only it may renew or release it (saga/agents/lease.py).
if not redis.call('SET', KEYS[7], ARGV[3], 'NX', 'PX', ARGV[2]) then return {'busy'} end
redis.call('HINCRBY', AGENT, 'model_calls', 1)
redis.call('HINCRBY', AGENT, ARGV[1] .. ':asked', 1)
return {'ok'}
