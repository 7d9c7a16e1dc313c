-- ARGV: 'renew' | 'release', token, lease_ms, turn. KEYS[7]: the turn's lease.
-- Renew (extend by lease_ms) or release the asking lease, only while ``token`` holds it: a
-- delivery whose lease ran out must never extend or end the lease of the one asking now.
local holder = redis.call('GET', KEYS[7])
if holder == ARGV[2] then
  if ARGV[1] == 'renew' then
    redis.call('PEXPIRE', KEYS[7], ARGV[3])
  else
    redis.call('DEL', KEYS[7])
  end
  return {'ok'}
end
-- A renewal that finds the lease gone and nobody else holding it: the store was away longer
-- than the lease (a failover) while this model call ran, and the lease ran out under it. The
-- call is still the turn's only one unless another delivery has asked since: take the lease
-- back, so that none asks now. With the turn answered, there is nothing left to hold.
if ARGV[1] == 'renew' and not holder and ARGV[4]
    and redis.call('HEXISTS', AGENT, ARGV[4] .. ':answer') == 0 then
  redis.call('SET', KEYS[7], ARGV[2], 'PX', ARGV[3])
  return {'retaken'}
end
return {'lost'}
