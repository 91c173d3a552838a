-- Reads up to max frames of a run's buffer from a sequence on.
-- KEYS: meta, frames, times.
-- ARGV: from sequence, max frames.
-- Reply: {first kept, next sequence, then (sequence, data, appended ms) per frame}.
local next = tonumber(redis.call('HGET', KEYS[1], 'next') or '1')
local first = tonumber(redis.call('HGET', KEYS[1], 'first') or '1')
local from = math.max(tonumber(ARGV[1]), first)
local last = math.min(next - 1, from + tonumber(ARGV[2]) - 1)
local out = {first, next}
for s = from, last do
  table.insert(out, s)
  table.insert(out, redis.call('HGET', KEYS[2], s) or '')
  table.insert(out, tonumber(redis.call('HGET', KEYS[3], s) or '0'))
end
return out
