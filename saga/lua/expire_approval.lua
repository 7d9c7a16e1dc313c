-- ARGV: call marker ('<turn>:<call>'), the refusal the model is told when it expired.
-- Judges a waiting approval on the Redis clock, atomically with decide_approval.lua: either
-- a person's decision lands first ('decided', and it stands) or the request expires first
-- (its refusal is recorded, and a later decision is refused as 'expired'); never both.
local decided = redis.call('HGET', AGENT, ARGV[1] .. ':decision')
if decided then return {'decided', decided} end
if redis.call('HEXISTS', AGENT, ARGV[1] .. ':refused') == 1 then return {'expired'} end
local pending = redis.call('HGET', AGENT, ARGV[1] .. ':approval')
if not pending then return {'unknown'} end
local request = cjson.decode(pending)
local due = tonumber(request.requested_at) + tonumber(redis.call('HGET', RUN, 'deadline') or '0')
if NOW <= due then return {'waiting', string.format('%.6f', due)} end
redis.call('HSET', AGENT, ARGV[1] .. ':refused', ARGV[2])
progress()
return {'expired'}
