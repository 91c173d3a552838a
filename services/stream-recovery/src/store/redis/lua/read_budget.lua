-- Reads a run's restart budget and lease as of now (an expired lease reads as free).
-- KEYS: lease, budget, meta.
-- ARGV: now ms.
-- Reply: {holder or '', expires or 0, attempts, claimed or -1, not_before or -1,
--   exhausted ('1' or '0'), next sequence, parked ('1' or '0')}.
local now = tonumber(ARGV[1])
local holder = redis.call('HGET', KEYS[1], 'controller') or ''
local expires = tonumber(redis.call('HGET', KEYS[1], 'expires') or '0')
if expires <= now then holder = ''; expires = 0 end
local b = redis.call('HMGET', KEYS[2], 'attempts', 'claimed', 'not_before', 'exhausted')
return {holder, expires, tonumber(b[1] or '0'), tonumber(b[2] or '-1'), tonumber(b[3] or '-1'),
        b[4] or '0', tonumber(redis.call('HGET', KEYS[3], 'next') or '1'),
        redis.call('HGET', KEYS[1], 'parked') or '0'}
