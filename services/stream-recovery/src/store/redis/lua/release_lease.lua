-- Removes the lease if the token holds it.
-- KEYS: lease.
-- ARGV: token.
-- Reply: 1 released, 0 not held by the token.
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
