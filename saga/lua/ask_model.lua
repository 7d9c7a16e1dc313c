-- ARGV: turn, lease_ms, token, most, fence_ms, gap_ms. KEYS[7]: the turn's lease (saga.constants.turn_lease_key).
-- One delivery of a turn asks the model at a time: a redelivery while a slow model still
-- answers the first must wait for that answer, not ask again. Taking the lease and counting
-- the policy call are one step, so a count never lacks its lease nor a lease its count. The
-- lease holds the asker's token: only it may renew or release it (saga/agents/lease.py).
-- ARGV[4]: the most policy calls a turn may make (0: no limit). The limit is judged here,
-- under the lease, not from the caller's picture: a delivery that read the count while
-- another was still asking must wait for that call's answer, not end the run under it.
-- A run that ended (aborted, reaped, unwinding) since the caller read it: nothing to ask. A
-- delivery may read the run, then wait out a fence for seconds: the call would be made, and
-- counted after the run's record was written, for a run nobody will read the answer of.
if redis.call('HGET', RUN, 'state') ~= 'running' then return {'ended'} end
-- An answer recorded since the caller read the run: nothing to ask (the caller plays again).
if redis.call('HEXISTS', AGENT, ARGV[1] .. ':answer') == 1 then return {'answered'} end
-- The same asker again (its reply lost, or its write not yet on a replica): counted once.
if redis.call('GET', KEYS[7]) == ARGV[3] then return {'ok'} end
if redis.call('EXISTS', KEYS[7]) == 1 then return {'busy'} end
-- The lease is gone, but the last asker never released it nor recorded an answer: it died,
-- or the store was away longer than the lease (a failover) while its model call ran, and its
-- keeper has not renewed yet. The lease's clock cannot tell the two apart; the asker's life
-- can. So the asker is fenced: this delivery claims the turn and may ask only once it has
-- seen the store answer, without a gap longer than ARGV[6] ms, for ARGV[5] ms in which the
-- last asker showed no life (a live one's renewal takes the lease back and ends the claim,
-- turn_lease.lua). A gap (the store away again, from this delivery's view) starts it over.
-- One delivery fences at a time; a claim whose delivery stopped asking is taken over.
local asker = redis.call('HGET', AGENT, ARGV[1] .. ':asker')
if asker and asker ~= ARGV[3] and tonumber(ARGV[5] or '0') > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local who, first, last = string.match(
    redis.call('HGET', AGENT, ARGV[1] .. ':claim') or '', '^(%S+) (%d+) (%d+)$')
  local watching = who and now - tonumber(last) <= tonumber(ARGV[6])
  -- Another delivery is fencing the asker already (a redelivery beside a revival): it asks
  -- once its fence is over, and this one waits for that answer. Taking its claim over would
  -- start both fences again, and two deliveries doing so in turn would never ask at all.
  if watching and who ~= ARGV[3] then return {'busy'} end
  if not watching then first = now end
  first = tonumber(first)
  if now - first < tonumber(ARGV[5]) then
    redis.call('HSET', AGENT, ARGV[1] .. ':claim', ARGV[3] .. ' ' .. first .. ' ' .. now)
    return {'fenced', tonumber(ARGV[5]) - (now - first)}
  end
end
redis.call('HDEL', AGENT, ARGV[1] .. ':claim')
redis.call('SET', KEYS[7], ARGV[3], 'PX', ARGV[2])
local asked = tonumber(redis.call('HGET', AGENT, ARGV[1] .. ':asked') or '0')
if tonumber(ARGV[4] or '0') > 0 and asked >= tonumber(ARGV[4]) then
  redis.call('DEL', KEYS[7])
  return {'spent', asked}
end
redis.call('HINCRBY', AGENT, 'model_calls', 1)
redis.call('HINCRBY', AGENT, ARGV[1] .. ':asked', 1)
redis.call('HSET', AGENT, ARGV[1] .. ':asker', ARGV[3])
return {'ok'}
