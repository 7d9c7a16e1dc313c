-- ARGV: run, steps, stack, comps (JSON: the hashes' fields and the stack's entries, every
--       value a string, as saga.picture.hashes_of renders a run's SQL record),
--       retention_seconds
-- Rebuild an ended run's keys from its SQL record once they have expired, so a requeue or a
-- resolve goes through the same scripts as within the retention period. Only into nothing:
-- if any of the run's keys exist again, they are the truth and nothing is written.
for _, key in ipairs({RUN, STEPS, INFLIGHT, STACK, COMPS}) do
  if redis.call('EXISTS', key) == 1 then return {'exists'} end
end
local function fill(key, fields)
  for name, value in pairs(fields) do redis.call('HSET', key, name, value) end
end
fill(RUN, cjson.decode(ARGV[1]))
fill(STEPS, cjson.decode(ARGV[2]))
for _, entry in ipairs(cjson.decode(ARGV[3])) do redis.call('RPUSH', STACK, entry) end
fill(COMPS, cjson.decode(ARGV[4]))
-- Recorded, so the keys expire again unless an operator's action reopens the run.
for _, key in ipairs({RUN, STEPS, STACK, COMPS}) do
  if redis.call('EXISTS', key) == 1 then redis.call('EXPIRE', key, ARGV[5]) end
end
return {'ok'}
