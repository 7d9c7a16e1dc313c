-- ARGV: 'renew' | 'release', token, lease_ms. KEYS[7]: the turn's lease.
-- Renew (extend by lease_ms) or release the asking lease, only while ``token`` holds it: a
-- delivery whose lease ran out must never extend or end the lease of the one asking now.
if redis.call('GET', KEYS[7]) ~= ARGV[2] then return {'lost'} end
if ARGV[1] == 'renew' then
  redis.call('PEXPIRE', KEYS[7], ARGV[3])
else
  redis.call('DEL', KEYS[7])
end
return {'ok'}
