-- Grants the lease to a run's first controller; the holder asking again gets its token
-- back with a fresh expiry. Once a lease was granted, later controllers come through a
-- claim, except the first controller of a later attempt of the run (meta `attempt` is
-- the attempt last granted): its earlier attempt's runner is gone, so it gets a fresh
-- lease, whoever held it, and spends no budget. Calls keep().
-- KEYS: lease, meta, frames, times.
-- ARGV: controller, token, ttl ms, now ms, LEASE_GC_FACTOR, STATE_TTL ms, attempt.
-- Reply: {'ok', token, expires, next sequence} | {'held', holder} | {'takeover'}.
local now = tonumber(ARGV[4])
local ttl = tonumber(ARGV[3])
local attempt = tonumber(ARGV[7])
local granted = redis.call('HGET', KEYS[2], 'granted') == '1'
local later = granted and attempt > tonumber(redis.call('HGET', KEYS[2], 'attempt') or '1')
local holder = redis.call('HGET', KEYS[1], 'controller')
local expires = tonumber(redis.call('HGET', KEYS[1], 'expires') or '0')
if holder and expires > now and not later then
  if holder == ARGV[1] then
    redis.call('HSET', KEYS[1], 'expires', now + ttl)
    redis.call('PEXPIRE', KEYS[1], ttl * tonumber(ARGV[5]))
    for k = 2, 4 do keep(KEYS[k], tonumber(ARGV[6])) end
    return {'ok', redis.call('HGET', KEYS[1], 'token'), now + ttl, tonumber(redis.call('HGET', KEYS[2], 'next') or '1')}
  end
  return {'held', holder}
end
if granted and not later then
  return {'takeover'}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'controller', ARGV[1], 'token', ARGV[2], 'expires', now + ttl)
redis.call('PEXPIRE', KEYS[1], ttl * tonumber(ARGV[5]))
redis.call('HSETNX', KEYS[2], 'next', 1)
redis.call('HSETNX', KEYS[2], 'first', 1)
redis.call('HSETNX', KEYS[2], 'bytes', 0)
redis.call('HSET', KEYS[2], 'granted', '1', 'attempt', attempt)
for k = 2, 4 do keep(KEYS[k], tonumber(ARGV[6])) end
return {'ok', ARGV[2], now + ttl, tonumber(redis.call('HGET', KEYS[2], 'next'))}
