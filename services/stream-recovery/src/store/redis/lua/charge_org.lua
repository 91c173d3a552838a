-- Reserves bytes against an org's hourly byte budget and against what its buffers may
-- hold (the counters of the hours a buffer may still hold frames of), or refuses without
-- charging. The org's keys share one hash tag: one slot, cluster-safe.
-- KEYS: the org's counters for the window's hours, oldest first; the last is this hour's.
-- ARGV: bytes, hour limit, buffer limit, counter ttl ms.
-- Reply: the hour's bytes left; -1 when the hour's budget refuses, -2 when the buffer
--   bound does.
local bytes = tonumber(ARGV[1])
local held = 0
for i = 1, #KEYS do held = held + tonumber(redis.call('GET', KEYS[i]) or '0') end
local used = tonumber(redis.call('GET', KEYS[#KEYS]) or '0')
if used + bytes > tonumber(ARGV[2]) then return -1 end
if held + bytes > tonumber(ARGV[3]) then return -2 end
used = redis.call('INCRBY', KEYS[#KEYS], bytes)
redis.call('PEXPIRE', KEYS[#KEYS], ARGV[4])
return tonumber(ARGV[2]) - used
