-- Gives bytes back to a counter that still exists: a refund after the hour's counter
-- expired must not leave a negative key without a TTL behind.
-- KEYS: the org's counter for the hour.
-- ARGV: bytes.
-- Reply: 0.
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('DECRBY', KEYS[1], ARGV[1]) end
return 0
