-- Extends the lease the token holds (and unparks it). Calls keep().
-- KEYS: lease, meta, frames, times.
-- ARGV: token, ttl ms, now ms, LEASE_GC_FACTOR, STATE_TTL ms.
-- Reply: {'ok', expires} | {'fenced'}.
local holder = redis.call('HGET', KEYS[1], 'token')
if holder and holder ~= ARGV[1] then return {'fenced'} end
local expires = tonumber(ARGV[3]) + tonumber(ARGV[2])
if not holder then
  -- The lease key was lost (Redis restarted, evicted, flushed): nobody else holds it, so
  -- it is no fence; the run's own controller takes it back.
  redis.call('HSET', KEYS[1], 'controller', 'resynced', 'token', ARGV[1])
  redis.call('HSETNX', KEYS[2], 'next', 1)
  redis.call('HSETNX', KEYS[2], 'first', 1)
  redis.call('HSETNX', KEYS[2], 'bytes', 0)
  redis.call('HSET', KEYS[2], 'granted', '1')
end
redis.call('HSET', KEYS[1], 'expires', expires)
redis.call('HDEL', KEYS[1], 'parked')
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * tonumber(ARGV[4]))
for k = 2, 4 do keep(KEYS[k], tonumber(ARGV[5])) end
return {'ok', expires}
