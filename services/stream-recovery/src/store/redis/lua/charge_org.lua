-- Reserves bytes against an org's hourly byte budget (its own key and slot:
-- cluster-safe), or refuses without charging.
-- KEYS: the org's counter for the hour.
-- ARGV: bytes, limit, ORG_HOUR_TTL ms.
-- Reply: the bytes left, or -1 when refused.
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local bytes, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
if used + bytes > limit then return -1 end
used = redis.call('INCRBY', KEYS[1], bytes)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return limit - used
