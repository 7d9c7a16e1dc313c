-- ARGV: 'renew' | 'release', token, lease_ms, turn. KEYS[7]: the turn's lease; the asker
-- and any claim fencing it are the turn's fields in the agent's hash (ask_model.lua).
-- Renew (extend by lease_ms) or release the asking lease, only while ``token`` holds it: a
-- delivery whose lease ran out must never extend or end the lease of the one asking now.
local holder = redis.call('GET', KEYS[7])
if holder == ARGV[2] then
  if ARGV[1] == 'renew' then
    redis.call('PEXPIRE', KEYS[7], ARGV[3])
  else
    redis.call('DEL', KEYS[7])
    if ARGV[4] and redis.call('HGET', AGENT, ARGV[4] .. ':asker') == ARGV[2] then
      redis.call('HDEL', AGENT, ARGV[4] .. ':asker')
    end
  end
  return {'ok'}
end
-- A release of a lease that ran out: the asker gave up its call, so nobody need fence it.
if ARGV[1] == 'release' then
  if ARGV[4] and redis.call('HGET', AGENT, ARGV[4] .. ':asker') == ARGV[2] then
    redis.call('HDEL', AGENT, ARGV[4] .. ':asker')
  end
  return {'lost'}
end
-- A renewal that finds the lease gone and nobody else holding it: the store was away longer
-- than the lease (a failover) while this model call ran, and the lease ran out under it. The
-- call is still the turn's only one unless another delivery has asked since (it is then the
-- turn's asker): take the lease back, so that none asks now, and end any claim fencing it. With the turn answered, there is nothing left to hold.
if ARGV[1] == 'renew' and not holder and ARGV[4]
    and redis.call('HEXISTS', AGENT, ARGV[4] .. ':answer') == 0
    and redis.call('HGET', AGENT, ARGV[4] .. ':asker') == ARGV[2] then
  redis.call('SET', KEYS[7], ARGV[2], 'PX', ARGV[3])
  redis.call('HDEL', AGENT, ARGV[4] .. ':claim')  -- alive: a delivery fencing it waits on
  return {'retaken'}
end
return {'lost'}
