-- Undoes the claim whose token is ARGV[1] if it is still the latest: the budget and the
-- lease go back to what the claim script stashed. The lease is restored only if the
-- claim's token still holds it.
-- KEYS: lease, budget.
-- ARGV: token.
-- Reply: 1 undone, 0 a later claim or nothing to undo.
if redis.call('HGET', KEYS[2], 'claim_token') ~= ARGV[1] then return 0 end
local p = redis.call('HMGET', KEYS[2], 'prev_attempts', 'prev_claimed', 'prev_not_before',
  'prev_controller', 'prev_token', 'prev_expires')
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  if p[4] and p[4] ~= '' then
    redis.call('HSET', KEYS[1], 'controller', p[4], 'token', p[5], 'expires', p[6])
  else
    redis.call('DEL', KEYS[1])
  end
end
local fields = {'attempts', 'claimed', 'not_before'}
for i = 1, 3 do
  if p[i] and p[i] ~= '' then
    redis.call('HSET', KEYS[2], fields[i], p[i])
  else
    redis.call('HDEL', KEYS[2], fields[i])
  end
end
redis.call('HDEL', KEYS[2], 'claim_token', 'prev_attempts', 'prev_claimed', 'prev_not_before',
  'prev_controller', 'prev_token', 'prev_expires')
return 1
