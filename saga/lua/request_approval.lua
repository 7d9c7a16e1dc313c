-- ARGV: call marker ('<turn>:<call>'), request_json (a JSON object without requested_at).
-- A call waits for a person: the request is stamped with the Redis clock, the one that
-- decide_approval.lua and expire_approval.lua judge its expiry on. First writer wins.
local field = ARGV[1] .. ':approval'
if redis.call('HEXISTS', AGENT, field) == 1 then return {'dup'} end
local request = string.sub(ARGV[2], 1, -2) .. ', "requested_at": ' .. NOW_S .. '}'
redis.call('HSET', AGENT, field, request)
progress()
return {'ok'}
