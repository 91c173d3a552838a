-- Plans and claims a takeover in one step: a lease once granted (only a lost controller
-- is replaced), lease free, not exhausted, budget window, not_before, then the new token
-- and {attempts, claimed, not_before} together. What the claim replaced is stashed for
-- unclaim. The wait after the n-th takeover is ARGV[8 + n], computed by
-- policy::backoff_ms (the one formula) for this claim's jitter draw. Calls keep().
-- KEYS: lease, budget, meta, frames, times.
-- ARGV: now ms, token, controller, lease ttl ms, STATE_TTL ms, RESET_AFTER ms,
--   MAX_ATTEMPTS, LEASE_GC_FACTOR, then the wait after each attempt from ARGV[9].
-- Reply: {'held'} | {'no_controller'} | {'exhausted', 1 if this claim spent it else 0} |
--   {'wait', not_before} | {'claimed', attempt, next sequence, not_before}.
local now = tonumber(ARGV[1])
local ttl = tonumber(ARGV[4])
local state_ttl = tonumber(ARGV[5])
local reset_after, max_attempts = tonumber(ARGV[6]), tonumber(ARGV[7])
local gc = ttl * tonumber(ARGV[8])
local l = redis.call('HMGET', KEYS[1], 'controller', 'token', 'expires', 'parked')
if l[4] == '1' then return {'held'} end
if l[1] and tonumber(l[3] or '0') > now then return {'held'} end
local m = redis.call('HMGET', KEYS[3], 'granted', 'next')
if m[1] ~= '1' then return {'no_controller'} end
local b = redis.call('HMGET', KEYS[2], 'attempts', 'claimed', 'not_before', 'exhausted')
if b[4] == '1' then return {'exhausted', 0} end
local attempts = tonumber(b[1] or '0')
local claimed = tonumber(b[2] or '0')
if attempts > 0 and now - claimed > reset_after then attempts = 0 end
if attempts >= max_attempts then
  redis.call('HSET', KEYS[2], 'exhausted', '1')
  redis.call('PEXPIRE', KEYS[2], state_ttl)
  return {'exhausted', 1}
end
if attempts > 0 and now < tonumber(b[3] or '0') then return {'wait', tonumber(b[3])} end
attempts = attempts + 1
local not_before = now + tonumber(ARGV[8 + attempts])
redis.call('HSET', KEYS[2], 'claim_token', ARGV[2], 'prev_attempts', b[1] or '',
  'prev_claimed', b[2] or '', 'prev_not_before', b[3] or '', 'prev_controller', l[1] or '',
  'prev_token', l[2] or '', 'prev_expires', l[3] or '',
  'attempts', attempts, 'claimed', now, 'not_before', not_before)
redis.call('PEXPIRE', KEYS[2], state_ttl)
redis.call('HSET', KEYS[1], 'controller', ARGV[3], 'token', ARGV[2], 'expires', now + ttl)
redis.call('PEXPIRE', KEYS[1], gc)
for k = 3, 5 do keep(KEYS[k], state_ttl) end
return {'claimed', attempts, tonumber(m[2] or '1'), not_before}
