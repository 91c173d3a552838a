-- Parks a lease with a token: no expiry, no key TTL, until unpark_lease (or a renewal).
-- KEYS: lease.
-- ARGV: the parked expiry (PARKED_EXPIRES_MS).
-- Reply: 1 parked, 0 no lease to park.
if not redis.call('HGET', KEYS[1], 'token') then return 0 end
redis.call('HSET', KEYS[1], 'parked', '1', 'expires', ARGV[1])
redis.call('PERSIST', KEYS[1])
return 1
