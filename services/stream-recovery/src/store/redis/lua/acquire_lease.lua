-- Grants the lease to a run's first controller; the holder asking again gets its token
-- back with a fresh expiry. Once a lease was granted, later controllers come through a
-- claim. Calls keep().
-- KEYS: lease, meta, frames, times.
-- ARGV: controller, token, ttl ms, now ms, LEASE_GC_FACTOR, STATE_TTL ms.
-- Reply: {'ok', token, expires, next sequence} | {'held', holder} | {'takeover'}.
local now = tonumber(ARGV[4])
local ttl = tonumber(ARGV[3])
local holder = redis.call('HGET', KEYS[1], 'controller')
local expires = tonumber(redis.call('HGET', KEYS[1], 'expires') or '0')
if holder and expires > now then
  if holder == ARGV[1] then
    redis.call('HSET', KEYS[1], 'expires', now + ttl)
    redis.call('PEXPIRE', KEYS[1], ttl * tonumber(ARGV[5]))
    for k = 2, 4 do keep(KEYS[k], tonumber(ARGV[6])) end
    return {'ok', redis.call('HGET', KEYS[1], 'token'), now + ttl, tonumber(redis.call('HGET', KEYS[2], 'next') or '1')}
  end
  return {'held', holder}
end
if redis.call('HGET', KEYS[2], 'granted') == '1' then
  return {'takeover'}
end
redis.call('HSET', KEYS[1], 'controller', ARGV[1], 'token', ARGV[2], 'expires', now + ttl)
redis.call('PEXPIRE', KEYS[1], ttl * tonumber(ARGV[5]))
redis.call('HSETNX', KEYS[2], 'next', 1)
redis.call('HSETNX', KEYS[2], 'first', 1)
redis.call('HSETNX', KEYS[2], 'bytes', 0)
redis.call('HSET', KEYS[2], 'granted', '1')
for k = 2, 4 do keep(KEYS[k], tonumber(ARGV[6])) end
return {'ok', ARGV[2], now + ttl, tonumber(redis.call('HGET', KEYS[2], 'next'))}
