-- Hands a parked lease back, same token: it expires a ttl from now again.
-- KEYS: lease.
-- ARGV: ttl ms, now ms, LEASE_GC_FACTOR.
-- Reply: 1 unparked, 0 not parked.
if redis.call('HGET', KEYS[1], 'parked') ~= '1' then return 0 end
redis.call('HDEL', KEYS[1], 'parked')
redis.call('HSET', KEYS[1], 'expires', tonumber(ARGV[2]) + tonumber(ARGV[1]))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * tonumber(ARGV[3]))
return 1
